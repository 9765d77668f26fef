"""A memory-pool process: mounts memory into a Mooncake Store and waits.

    python -m kvtier_mooncake.pool --master 127.0.0.1:50051 \
        --metadata-server http://127.0.0.1:8080/metadata --bytes 268435456

In Mooncake Store the memory that holds objects is contributed by clients ("segments");
a client's segment goes away when it closes. Run one or more of these beside the master so
that pages outlive the inference servers that put them. Exits on SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--master", required=True, help="host:port of mooncake_master's RPC")
    ap.add_argument("--metadata-server", required=True, help="http://host:port/metadata")
    ap.add_argument("--bytes", type=int, required=True, help="memory to contribute")
    ap.add_argument("--hostname", default="127.0.0.1", help="address other clients reach")
    ap.add_argument("--ready-file", default=None, help="touched once the pool is mounted")
    args = ap.parse_args(argv)

    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = store.setup(
        args.hostname, args.metadata_server, args.bytes, 16 << 20, "tcp", "", args.master
    )
    if rc != 0:
        print(f"mooncake pool: setup failed with code {rc}", file=sys.stderr)
        return 1
    if args.ready_file:
        Path(args.ready_file).touch()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
