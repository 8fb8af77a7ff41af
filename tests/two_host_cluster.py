"""A Spark standalone cluster of two "hosts" on this one machine, for multi-host tests.

The master and the driver (this process) stay in the machine's own network namespace, on a
bridge of their own. Each worker runs in a network namespace and a UTS namespace of its own:
its own address on the bridge (reached over a veth pair) and its own hostname, so ranks
on different workers see different hosts, and the link to one host can be cut
(`cut_link`) and restored like a real cable. Needs root; `start` raises `Unavailable` with
the reason where namespaces are not permitted.

Everything it creates (processes, namespaces, links) is removed by `stop`, which every
exit path reaches.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

START_TIMEOUT_S = 90.0
CORES_PER_HOST = 2


class Unavailable(Exception):
    """This machine cannot host the cluster (not root, no iproute2, namespaces refused)."""


@dataclass
class Host:
    name: str  # its hostname, as ranks on it report
    namespace: str
    address: str
    link: str  # the veth end on the bridge: down = the cable is cut
    worker: subprocess.Popen | None = None


@dataclass
class TwoHostCluster:
    tag: str = field(default_factory=lambda: f"{os.getpid() % 100000}")
    hosts: list[Host] = field(default_factory=list)
    master: subprocess.Popen | None = None
    master_url: str = ""
    driver_address: str = ""
    directory: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="ddl-cluster-")))
    cores_per_host: int = CORES_PER_HOST  # the task slots each worker offers

    @property
    def bridge(self) -> str:
        return f"ddlbr{self.tag}"

    # ---- building it ------------------------------------------------------------------------

    def start(self) -> "TwoHostCluster":
        if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("unshare") is None:
            raise Unavailable("a two-host cluster needs root, iproute2 and unshare (network and "
                              "UTS namespaces, veth pairs)")
        subnet = f"10.{150 + os.getpid() % 50}.{os.getpid() % 250}"
        self.driver_address = f"{subnet}.1"
        try:
            _run("ip", "link", "add", self.bridge, "type", "bridge")
        except subprocess.CalledProcessError as exc:
            raise Unavailable(f"cannot create links here: {exc.stderr.strip()}") from None
        try:
            _run("ip", "addr", "add", f"{self.driver_address}/24", "dev", self.bridge)
            _run("ip", "link", "set", self.bridge, "up")
            for index, letter in enumerate("ab"):
                self.hosts.append(self._add_host(f"ddl-host-{letter}-{self.tag}",
                                                 f"ddl{self.tag}{letter}", f"{subnet}.{index + 2}",
                                                 f"ddl{self.tag}{letter}o"))
            self._start_master()
            for host in self.hosts:
                self.start_worker(host)
            self._wait_for_workers(len(self.hosts))
        except BaseException:
            self.stop()
            raise
        return self

    def _add_host(self, name: str, namespace: str, address: str, link: str) -> Host:
        inside = f"{link[:-1]}i"
        _run("ip", "netns", "add", namespace)
        host = Host(name, namespace, address, link)
        self.hosts.append(host)  # removed by stop() from here on
        _run("ip", "link", "add", link, "type", "veth", "peer", "name", inside)
        _run("ip", "link", "set", link, "master", self.bridge)
        _run("ip", "link", "set", link, "up")
        _run("ip", "link", "set", inside, "netns", namespace)
        _in(namespace, "ip", "addr", "add", f"{address}/24", "dev", inside)
        _in(namespace, "ip", "link", "set", inside, "up")
        _in(namespace, "ip", "link", "set", "lo", "up")
        self.hosts.remove(host)
        return host

    def _start_master(self) -> None:
        log = self.directory / "master.log"
        self.master = subprocess.Popen(
            [_spark_class(), "org.apache.spark.deploy.master.Master", "--host",
             self.driver_address, "--port", "0", "--webui-port", "0"],
            stdout=log.open("w"), stderr=subprocess.STDOUT, env=self._environment(self.driver_address),
            start_new_session=True)
        found = _wait_for_line(log, r"Starting Spark master at (spark://\S+)", self.master)
        self.master_url = found.group(1)

    def start_worker(self, host: Host) -> None:
        """Start (or restart) the worker of `host`, in its namespaces."""
        log = self.directory / f"worker-{host.name}.log"
        command = (f"hostname {host.name} && exec {_spark_class()} "
                   f"org.apache.spark.deploy.worker.Worker --host {host.address} "
                   f"--cores {self.cores_per_host} --memory 2g --webui-port 0 "
                   f"--work-dir {self.directory / host.name} {self.master_url}")
        host.worker = subprocess.Popen(
            ["ip", "netns", "exec", host.namespace, "unshare", "--uts", "sh", "-c", command],
            stdout=log.open("w"), stderr=subprocess.STDOUT, env=self._environment(host.address),
            start_new_session=True)

    def _wait_for_workers(self, count: int) -> None:
        log = self.directory / "master.log"
        deadline = time.monotonic() + START_TIMEOUT_S
        while len(re.findall(r"Registering worker", log.read_text())) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{count} workers did not register within "
                                   f"{START_TIMEOUT_S:.0f} s: see {self.directory}")
            for host in self.hosts:
                if host.worker.poll() is not None:
                    raise RuntimeError(f"the worker of {host.name} exited: "
                                       f"{(self.directory / f'worker-{host.name}.log').read_text()[-2000:]}")
            time.sleep(0.2)

    def _environment(self, address: str) -> dict:
        environment = dict(os.environ, SPARK_LOCAL_IP=address, PYSPARK_PYTHON=sys.executable,
                           SPARK_LOG_DIR=str(self.directory), SPARK_NO_DAEMONIZE="1")
        environment.pop("SPARK_REMOTE", None)
        return environment

    def spark_session(self, app_name: str, slots: int):
        """A SparkSession of this process on the cluster, once executors with `slots` task slots
        in all have registered (until then a barrier stage of that size is refused). The
        caller sets PYSPARK_PYTHON and SPARK_LOCAL_IP (= `driver_address`) and stops it."""
        from pyspark import SparkContext
        from pyspark.sql import SparkSession

        if SparkContext._gateway is None:
            # The JVM keeps the environment it starts with. Started here, it would keep the
            # caller's SPARK_LOCAL_IP (this cluster's address) for good, and every later local
            # session of this process would bind to an address gone with the cluster. Start it
            # on loopback: this session names its own address below.
            saved = os.environ.get("SPARK_LOCAL_IP")
            os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
            try:
                SparkContext._ensure_initialized()
            finally:
                if saved is None:
                    del os.environ["SPARK_LOCAL_IP"]
                else:
                    os.environ["SPARK_LOCAL_IP"] = saved
        session = (SparkSession.builder.master(self.master_url).appName(app_name)
                   .config("spark.driver.host", self.driver_address)
                   .config("spark.driver.bindAddress", self.driver_address)
                   .config("spark.executor.memory", "1g")
                   .config("spark.ui.enabled", "false")
                   .config("spark.ui.showConsoleProgress", "false")
                   .getOrCreate())
        session.sparkContext.setLogLevel("ERROR")
        deadline = time.monotonic() + START_TIMEOUT_S
        while session.sparkContext.defaultParallelism < slots:
            if time.monotonic() > deadline:
                session.stop()
                raise TimeoutError(f"executors with {slots} slots did not register within "
                                   f"{START_TIMEOUT_S:.0f} s: see {self.directory}")
            time.sleep(0.2)
        return session

    # ---- faults -----------------------------------------------------------------------------

    def cut_link(self, host: Host) -> None:
        _run("ip", "link", "set", host.link, "down")

    def restore_link(self, host: Host) -> None:
        _run("ip", "link", "set", host.link, "up")

    # ---- taking it down ---------------------------------------------------------------------

    def stop(self) -> None:
        """Kill every process of the cluster, then remove its namespaces and links."""
        import psutil

        for process in [self.master] + [host.worker for host in self.hosts]:
            if process is None:
                continue
            try:
                tree = [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
            except psutil.NoSuchProcess:
                tree = []
            for member in tree:
                try:
                    member.kill()
                except psutil.NoSuchProcess:
                    pass
            process.wait(timeout=30)
        for host in self.hosts:  # processes a namespace still holds (an executor's Python workers)
            pids = subprocess.run(["ip", "netns", "pids", host.namespace], capture_output=True,
                                  text=True, timeout=30).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), 9)
                except ProcessLookupError:
                    pass
            subprocess.run(["ip", "link", "del", host.link], capture_output=True, timeout=30)
            subprocess.run(["ip", "netns", "del", host.namespace], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, timeout=30)
        shutil.rmtree(self.directory, ignore_errors=True)


def _run(*command: str) -> None:
    subprocess.run(command, check=True, capture_output=True, text=True, timeout=30)


def _in(namespace: str, *command: str) -> None:
    _run("ip", "netns", "exec", namespace, *command)


def _spark_class() -> str:
    import pyspark

    return str(Path(pyspark.__file__).parent / "bin" / "spark-class")


def _wait_for_line(log: Path, pattern: str, process: subprocess.Popen) -> re.Match:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        found = re.search(pattern, log.read_text())
        if found:
            return found
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"no {pattern!r} from {process.args[1]}: {log.read_text()[-2000:]}")
        time.sleep(0.1)
