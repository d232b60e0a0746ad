"""A throw-away one-node SLURM cluster for the launcher tests.

munged, slurmctld and slurmd run in the foreground as children of the test process, from a
temporary directory (state, spool, logs, munge key and socket), on private ports, with the config of
``slurm/local-cluster/`` (``slurm.conf.in`` filled in, ``cgroup.conf`` copied). ``stop()`` cancels
jobs, ends the daemons and any ``slurmstepd`` they left (found by this cluster's ``SLURM_CONF`` in
their environment), and removes the directory. Needs root (SlurmUser=root) and the Debian
packages ``slurmctld slurmd slurm-client munge`` (``scripts/install_test_deps.sh``).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONFIG_DIR = REPO / "slurm" / "local-cluster"
BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "sinfo", "squeue", "scancel", "scontrol")


def missing_reason() -> str | None:
    """Why the cluster cannot start here, or None."""
    missing = [b for b in BINARIES if shutil.which(b) is None and not Path("/usr/sbin", b).exists()]
    if missing:
        return f"SLURM test cluster needs {', '.join(missing)} (scripts/install_test_deps.sh installs them)"
    if os.geteuid() != 0:
        return "SLURM test cluster runs its daemons as root (SlurmUser=root); not root here"
    return None


def _which(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class LocalSlurmCluster:
    def __init__(self, cpus: int = 4):
        self.cpus = max(cpus, 2)
        self.dir = Path(tempfile.mkdtemp(prefix="tgdist-slurm-"))
        self.node = socket.gethostname().split(".")[0]
        self.conf = self.dir / "etc" / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        for var in [v for v in self.env if v.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_")) and v != "SLURM_CONF"]:
            del self.env[var]  # a test run inside a real allocation must not leak into this one
        self.procs: dict[str, subprocess.Popen] = {}

    # ------------------------------------------------------------ lifecycle

    def start(self, timeout: float = 60.0) -> "LocalSlurmCluster":
        d = self.dir
        os.chmod(d, 0o755)  # munged checks that its socket's directories are searchable
        for sub, mode in (("etc", 0o755), ("state", 0o755), ("spool", 0o755), ("run", 0o755), ("log", 0o755),
                          ("munge", 0o700), ("msock", 0o755)):
            (d / sub).mkdir(mode=mode)
            os.chmod(d / sub, mode)
        ctld_port, slurmd_port = _free_ports(2)
        text = (CONFIG_DIR / "slurm.conf.in").read_text()
        for key, value in {"@DIR@": str(d), "@HOST@": self.node, "@NODE@": self.node, "@CTLD_PORT@": str(ctld_port),
                           "@SLURMD_PORT@": str(slurmd_port), "@CPUS@": str(self.cpus)}.items():
            text = text.replace(key, value)
        self.conf.write_text(text)
        shutil.copy(CONFIG_DIR / "cgroup.conf", d / "etc" / "cgroup.conf")
        key = d / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o600)

        sock = d / "msock" / "munge.socket"
        self._spawn("munged", [_which("munged"), "-F", f"--socket={sock}", f"--key-file={key}",
                               f"--pid-file={d / 'run' / 'munged.pid'}", f"--log-file={d / 'log' / 'munged.log'}",
                               f"--seed-file={d / 'munge' / 'seed'}"])
        self._wait(lambda: sock.exists(), timeout, "munged socket")
        self._spawn("slurmctld", [_which("slurmctld"), "-D", "-i", "-f", str(self.conf)])
        self._spawn("slurmd", [_which("slurmd"), "-D", "-N", self.node, "-f", str(self.conf)])
        self._wait(self._node_idle, timeout, f"node {self.node} idle")
        return self

    def stop(self) -> None:
        """Cancel jobs, end the daemons and anything they left behind, remove the directory."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            subprocess.run([_which("scancel"), "--full", "--partition=debug"], env=self.env,
                           capture_output=True, timeout=20)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and self.squeue():
                time.sleep(0.5)
        for name in ("slurmd", "slurmctld", "munged"):
            p = self.procs.get(name)
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(timeout=5)
        for pid in self._leftover_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "LocalSlurmCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------ commands

    def cmd(self, args: list[str], timeout: float = 120.0, cwd: Path | None = None) -> subprocess.CompletedProcess:
        """Run a SLURM client command against this cluster."""
        return subprocess.run(args, env=self.env, capture_output=True, text=True, timeout=timeout, cwd=cwd or REPO)

    def squeue(self) -> list[str]:
        r = self.cmd([_which("squeue"), "-h", "-o", "%i %T"], timeout=20)
        return [ln for ln in r.stdout.splitlines() if ln.strip()]

    def logs(self) -> str:
        out = []
        for f in sorted((self.dir / "log").glob("*")):
            out.append(f"== {f.name}\n" + "\n".join(f.read_text(errors="replace").splitlines()[-30:]))
        return "\n".join(out)

    # ------------------------------------------------------------ internals

    def _spawn(self, name: str, argv: list[str]) -> None:
        out = open(self.dir / "log" / f"{name}.out", "w")
        self.procs[name] = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
        out.close()

    def _node_idle(self) -> bool:
        r = self.cmd([_which("sinfo"), "-h", "-N", "-o", "%T"], timeout=20)
        return r.returncode == 0 and r.stdout.strip() == "idle"

    def _wait(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead:
                raise RuntimeError(f"{', '.join(dead)} exited while waiting for {what}\n{self.logs()}")
            if ready():
                return
            time.sleep(0.3)
        raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}\n{self.logs()}")

    def _leftover_pids(self) -> list[int]:
        """Processes started by this cluster that outlived its daemons (slurmstepd and job tasks):
        they carry this cluster's SLURM_CONF in their environment."""
        mark = f"SLURM_CONF={self.conf}".encode()
        pids = []
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit() or int(proc.name) == os.getpid():
                continue
            try:
                if mark in (proc / "environ").read_bytes().split(b"\0"):
                    pids.append(int(proc.name))
            except OSError:
                continue
        return pids
