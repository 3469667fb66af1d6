"""The SparkSession a fit runs on, and what a master URL says about the task slots.

``spark_session(master)`` gives the session this process already has, or starts one on
``master`` and stops it afterwards (unless its JVM died: ``jvm_exit`` says so). On a local
master (``local[N]``, ``local-cluster[...]``) everything runs on this machine, so the
executors use this Python and the loopback address; on a cluster, the cluster's own
settings (spark-submit, spark-defaults) decide.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import sys

from pyspark.sql import SparkSession

from dl4py.errors import BackendError, ConfigError

_LOCAL = re.compile(r"^local(?:\[(\*|\d+)(?:,\s*\d+)?\])?$")
_LOCAL_CLUSTER = re.compile(r"^local-cluster\[\s*(\d+)\s*,\s*(\d+)\s*,\s*\d+\s*\]$")


def local_slots(master: str) -> int | None:
    """How many tasks a local master runs at once (None: a cluster, which only it knows)."""
    found = _LOCAL.match(master)
    if found:
        cores = found.group(1)
        return 1 if cores is None else (os.cpu_count() or 1) if cores == "*" else int(cores)
    found = _LOCAL_CLUSTER.match(master)
    if found:
        return int(found.group(1)) * int(found.group(2))
    return None


def check_slots(master: str, workers: int) -> None:
    """TorchDistributor starts every rank at once (a barrier stage): a local master with
    fewer task slots would wait for them forever, so that is refused up front."""
    slots = local_slots(master)
    if slots is not None and workers > slots:
        raise ConfigError("workers", f"is {workers} but the Spark master {master} runs at most {slots} task"
                                     f"{'' if slots == 1 else 's'} at once, and every rank must run at the same "
                                     f"time; use at most {slots} workers or a master with more slots, "
                                     f"e.g. local[{workers}]")


@contextlib.contextmanager
def spark_session(master: str | None = None, *, workers: int = 2, app_name: str = "dl4py", conf: dict | None = None):
    """``with spark_session("local[4]") as spark: ...``: this process's active session, or a
    new one on ``master`` (default ``local[workers]``), stopped on leaving when it is new.

    ``conf``: extra Spark settings for a new session (e.g. ``spark.task.resource.gpu.amount``)."""
    active = SparkSession.getActiveSession()
    if active is not None:
        running = active.sparkContext.master
        if master is not None and master != running:
            raise ConfigError("spark_master", f"is {master} but this process already runs a SparkSession on "
                                              f"{running}; stop it first or leave the master out")
        yield active
        return
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        raise BackendError("Spark needs a Java 17 runtime (java on PATH or JAVA_HOME), e.g. "
                           "apt-get install openjdk-17-jre-headless")
    master = master or f"local[{workers}]"
    builder = SparkSession.builder.master(master).appName(app_name)
    if local_slots(master) is not None:
        # One machine: the executors run this Python, and nothing needs another interface.
        builder = (builder.config("spark.pyspark.python", sys.executable)
                   .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1"))
    for key, value in (conf or {}).items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    try:
        yield session
    finally:
        if jvm_exit(session) is None:
            session.stop()
        # else: stopping would only fail too (py4j cannot reach a dead JVM); the fit has said why


def jvm_exit(spark) -> tuple[int, int] | None:
    """``(pid, exitcode)`` of the session's JVM once it has ended (-N: killed by signal N);
    None while it runs, or when this process did not start it (spark-submit started this
    one from the JVM: then only py4j's errors tell)."""
    process = getattr(spark.sparkContext._gateway, "proc", None)  # pyspark keeps the JVM's Popen there
    if process is None or process.poll() is None:
        return None
    return process.pid, process.returncode
