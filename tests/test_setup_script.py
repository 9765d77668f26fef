"""scripts/setup-system-packages (issue 12): it says what it installs and why, keeps
Debian's redis-server from starting a service during the install (policy-rc.d, put back
after), and never stops or kills a process it did not start.

Run against stand-ins for ``apt-get`` and ``id`` in a private PATH, and a private
policy-rc.d path: nothing on the machine is installed or changed.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "setup-system-packages"

FAKE_APT = """#!/bin/sh
# Record each call, and what policy-rc.d answered when the install ran.
echo "apt-get $*" >> "$LOG"
case "$*" in
  *install*)
    if [ -x "$KVTIER_POLICY_RC_D" ]; then
      "$KVTIER_POLICY_RC_D" redis-server start; echo "policy says $?" >> "$LOG"
    else
      echo "no policy" >> "$LOG"
    fi ;;
esac
exit 0
"""


def _bin(tmp_path: Path, *, root: bool) -> Path:
    """A PATH directory with the tools the script uses, and no redis-server or fio."""
    b = tmp_path / "bin"
    b.mkdir()
    for tool in ("mktemp", "cp", "rm", "chmod", "cat"):
        found = shutil.which(tool)
        assert found is not None
        (b / tool).symlink_to(found)
    (b / "apt-get").write_text(FAKE_APT)
    (b / "id").write_text(f"#!/bin/sh\necho {0 if root else 1000}\n")
    for f in ("apt-get", "id"):
        (b / f).chmod(0o755)
    return b


def _run(tmp_path: Path, root: bool = True) -> tuple[subprocess.CompletedProcess[str], Path]:
    b = _bin(tmp_path, root=root)
    log = tmp_path / "log"
    env = {"PATH": str(b), "LOG": str(log), "KVTIER_POLICY_RC_D": str(tmp_path / "policy-rc.d")}
    bash = shutil.which("bash")
    assert bash is not None
    done = subprocess.run([bash, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)
    return done, log


@pytest.fixture
def bystander(tmp_path: Path):
    """A process named redis-server that the script did not start (someone's Redis)."""
    sleep = shutil.which("sleep")
    assert sleep is not None
    fake = tmp_path / "redis-server"
    shutil.copy(sleep, fake)
    proc = subprocess.Popen([str(fake), "300"])
    yield proc
    proc.kill()
    proc.wait()


def test_installs_with_service_starts_forbidden_and_kills_nothing(
    tmp_path: Path, bystander: subprocess.Popen[bytes]
) -> None:
    done, log = _run(tmp_path)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    # Says what and why.
    assert "installing redis-server fio" in out
    assert "private servers on 127.0.0.1" in out and "raw-disk baseline" in out
    calls = log.read_text().splitlines()
    assert calls[0] == "apt-get update -qq"
    assert calls[1].startswith("apt-get install") and "redis-server fio" in calls[1]
    assert calls[2] == "policy says 101"  # no service could start during the install
    assert not (tmp_path / "policy-rc.d").exists()  # and the policy is gone after
    assert bystander.poll() is None  # someone else's redis-server still runs


def test_an_existing_policy_is_put_back(tmp_path: Path) -> None:
    policy = tmp_path / "policy-rc.d"
    policy.write_text("#!/bin/sh\nexit 0\n")
    policy.chmod(0o755)
    done, log = _run(tmp_path)
    assert done.returncode == 0, done.stderr
    assert "policy says 101" in log.read_text()
    assert policy.read_text() == "#!/bin/sh\nexit 0\n"


def test_without_root_it_installs_nothing_and_says_so(tmp_path: Path) -> None:
    done, log = _run(tmp_path, root=False)
    assert done.returncode == 0 and "skipped (needs root and apt-get)" in done.stdout
    assert not log.exists()


#: ``kill [-SIG] "$VAR"``: a signal to the pid held in one variable
_KILL = re.compile(r'\bkill\s+(?:-[A-Z0-9]+\s+)?"?\$\{?(\w+)\}?"?(?=[\s;|&)]|$)')


def foreign_kills(text: str) -> list[str]:
    """The lines of a script that stop or kill a process it may not have started: any
    ``pkill``, ``killall``, service stop, and every ``kill`` except one whose only target is
    a variable the same script set from ``$!`` (the pid of a job it started itself)."""
    own = set(re.findall(r"\b(\w+)=\$!", text))
    bad = []
    for line in text.splitlines():
        code = line.split("#", 1)[0]
        if any(
            w in code for w in ("pkill", "killall", "service redis-server stop", "systemctl stop")
        ):
            bad.append(line)
        elif re.search(r"\bkill\b", code):
            targets = _KILL.findall(code)
            every_kill_names_a_variable = len(targets) == len(re.findall(r"\bkill\b", code))
            if not (targets and every_kill_names_a_variable and set(targets) <= own):
                bad.append(line)
    return bad


def test_the_kill_check_tells_own_jobs_from_others() -> None:
    mine = 'sleep 9 &\nPID=$!\nkill -INT "$PID"\nkill -0 "$PID" 2>/dev/null || true\n'
    assert foreign_kills(mine) == []
    for text in (
        'kill -INT "$PID"\n',  # not set from $!
        "PID=$!\nkill 1234\n",  # a literal pid
        "PID=$!\nkill $(pgrep redis)\n",
        "PID=$!\nkill -- -$PID\n",  # a process group
        "pkill redis-server\n",
        "killall valkey-server\n",
        "systemctl stop redis\n",
    ):
        assert foreign_kills(text), text


def test_no_setup_script_stops_or_kills_processes() -> None:
    for path in (ROOT / "scripts").iterdir():
        assert foreign_kills(path.read_text()) == [], path.name
    assert os.access(SCRIPT, os.X_OK)


def _need_disk(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(ROOT / "scripts" / "need-disk"), *args],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        check=False,
    )


def test_need_disk_stops_with_the_figures_when_the_disk_is_short(tmp_path: Path) -> None:
    """scripts/setup checks the free space before each large install."""
    free_mib = shutil.disk_usage(tmp_path).free // (1 << 20)
    ok = _need_disk("a small thing", "1", str(tmp_path))
    assert ok.returncode == 0, ok.stderr
    short = _need_disk("a huge thing", str(free_mib + 10**9), str(tmp_path))
    assert short.returncode == 1
    assert "a huge thing needs about" in short.stderr and str(tmp_path) in short.stderr
    skipped = _need_disk(
        "a huge thing", str(free_mib + 10**9), str(tmp_path), KVTIER_SKIP_DISK_CHECK="1"
    )
    assert skipped.returncode == 0
    bad = _need_disk("x", "5GB")
    assert bad.returncode == 2 and "whole number of MiB" in bad.stderr
    setup = (ROOT / "scripts" / "setup").read_text() + (ROOT / "scripts" / "setup-vllm").read_text()
    assert setup.count("|| scripts/need-disk ") == 2  # before .venv and .venv-vllm
