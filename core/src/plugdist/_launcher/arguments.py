"""The ``plugdist-run`` command line: torchrun's flags with torchrun's meaning -> LaunchConfig.

Every flag takes both spellings (``--nproc-per-node`` and ``--nproc_per_node``) and, as in
torchrun, its default from the environment variable ``PET_<FLAG>`` (``PET_NNODES=2``). An
unknown flag is an error that names the closest known one; flags may not be abbreviated.
"""

from __future__ import annotations

import argparse
import difflib
import glob
import hashlib
import json
import os
import re
import sys
from collections.abc import Mapping, Sequence
from datetime import timedelta

from plugdist._launcher.config import (
    LaunchConfig,
    RendezvousOptions,
    parse_filters,
    parse_nnodes,
    parse_signals,
    parse_streams,
)
from plugdist._launcher.numa import NUMA_MODES

__all__ = ["build_parser", "parse_args", "split_argv", "PROG"]

PROG = "plugdist-run"
DEFAULT_MASTER_PORT = 29500


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")


def _both(name: str) -> list[str]:
    """``--a-b`` and ``--a_b`` (torchrun accepts both)."""
    alt = name.replace("-", "_")
    return [name] if alt[2:] == name[2:] else [name, "--" + alt[2:]]


def build_parser() -> tuple[argparse.ArgumentParser, set[str], list[str]]:
    """The parser, the option strings that take a value, and every option string."""
    p = _Parser(prog=PROG, allow_abbrev=False,
                usage=f"{PROG} [options] script_or_module [args ...]",
                description="Start the worker processes of a plugdist (or torch.distributed) run "
                            "on this node, as torchrun does. Everything after the script or "
                            "module is passed to it untouched.")
    takes_value: set[str] = set()

    def opt(*names: str, **kw: object) -> None:
        flags = [n for name in names for n in (_both(name) if name.startswith("--") else [name])]
        p.add_argument(*flags, **kw)  # type: ignore[arg-type]
        if kw.get("action") is None:
            takes_value.update(flags)

    opt("--nnodes", default="1", metavar="N|MIN:MAX",
        help="number of nodes, or the range MIN:MAX for an elastic run (default 1)")
    opt("--nproc-per-node", default="1", metavar="N|auto|cpu|gpu|xpu",
        help="workers on this node: a number, cpu (one per core), gpu (one per NVIDIA GPU), "
             "xpu (one per Intel GPU), auto (gpu if any, else cpu); default 1")
    opt("--node-rank", type=int, default=None, metavar="K",
        help="this node's rank in [0, nnodes); default: assigned at rendezvous (static: 0)")
    opt("--master-addr", default=None, metavar="ADDR",
        help="static rendezvous: the address of node 0, whose launcher serves the store "
             "(default 127.0.0.1)")
    opt("--master-port", type=int, default=None, metavar="PORT",
        help="static rendezvous: the store's port on node 0 (default: a free port on one node, "
             f"{DEFAULT_MASTER_PORT} on several)")
    opt("--standalone", action="store_true",
        help="one node: a private store on 127.0.0.1 at a free port and a random run id")
    opt("--rdzv-backend", default="static", metavar="static|c10d|STORE",
        help="static: fixed --nnodes and node 0 at --master-addr; c10d: nodes meet at "
             "--rdzv-endpoint, ranks assigned there; an installed store scheme (etcd with "
             "plugdist-etcd): as c10d, through that store at --rdzv-endpoint, which is then "
             "the workers' store too (default static)")
    opt("--rdzv-endpoint", default="", metavar="HOST:PORT",
        help="c10d: where the rendezvous store is; the first launcher that can bind it serves it")
    opt("--rdzv-id", "--run-id", default=None, metavar="ID",
        help="the run's id, the same on every node (TORCHELASTIC_RUN_ID; default random on one "
             "node; on several, the scheduler's job id (SLURM_JOB_ID, PBS_JOBID, ...) or else a "
             "digest of the endpoint, sizes and command, so that another job on the same "
             "endpoint keeps to its own rounds)")
    opt("--rdzv-conf", default="", metavar="K=V,...",
        help="join_timeout, last_call_timeout, close_timeout, read_timeout (seconds), "
             "keep_alive_interval, keep_alive_max_attempt, token_file (a file holding the "
             "store's secret, the same on every node), token= (empty: no token)")
    opt("--max-restarts", type=int, default=0, metavar="N",
        help="restart every worker of every node up to N times after a failure (default 0)")
    opt("--replace-failed", action="store_true",
        help="when a worker dies, keep the others running and start one new worker that joins "
             "the running world (plugdist resilient groups); --max-restarts then counts "
             "replacements")
    opt("--monitor-interval", type=float, default=0.1, metavar="S",
        help="seconds between checks of the workers (default 0.1)")
    opt("--start-method", default="spawn", choices=("spawn", "fork", "forkserver"),
        help="accepted for torchrun compatibility; workers are always new processes")
    opt("--event-log-handler", default="null", metavar="NAME",
        help="accepted for torchrun compatibility; ignored")
    opt("--role", default="default", metavar="NAME", help="the workers' role (ROLE_NAME)")
    opt("-m", "--module", action="store_true", help="run `python -m MODULE args`")
    opt("--no-python", action="store_true",
        help="run the entrypoint as a program, without python in front")
    opt("--run-path", action="store_true",
        help="accepted for torchrun compatibility: the script runs with python as usual")
    opt("--log-dir", default=None, metavar="DIR",
        help="keep each worker's stdout, stderr and error file under "
             "DIR/RUN_ID_XXXXXXXX/attempt_N/LOCAL_RANK/")
    opt("-r", "--redirects", default="0", metavar="0-3|R:V,...",
        help="send streams to the log files only: 1 stdout, 2 stderr, 3 both (per local rank: "
             "0:3,1:0)")
    opt("-t", "--tee", default="0", metavar="0-3|R:V,...",
        help="copy streams to the log files and the console (same values as --redirects)")
    opt("--rank-prefix", action=argparse.BooleanOptionalAction, default=True,
        help="prefix each console line of worker output with [rank N] (default on)")
    opt("--local-ranks-filter", default="", metavar="R,...",
        help="show only these local ranks' output on the console (files keep everything)")
    opt("--duplicate-stdout-filters", default="", metavar="TEXT,...",
        help="also write every stdout line containing one of these strings (any local rank) to "
             "attempt_N/filtered_stdout.log in the log directory; ,, is a literal comma")
    opt("--duplicate-stderr-filters", default="", metavar="TEXT,...",
        help="the same for stderr, into attempt_N/filtered_stderr.log")
    opt("--logs-specs", default=None, metavar="NAME",
        help="accepted for torchrun compatibility: only 'default' (plugdist-run's own log "
             "layout, see --log-dir)")
    opt("--numa-binding", default=None, metavar="node|socket|exclusive|core-complex",
        help="bind each worker to the CPUs of its NUMA node (its GPU's, else nodes shared out "
             "by local rank): the node's, its socket's, an exclusive share of the node's "
             "cores, or one last-level-cache core complex")
    opt("--virtual-local-rank", action="store_true",
        help="every worker sees LOCAL_RANK=0 and, through CUDA_VISIBLE_DEVICES, only the GPU "
             "of its local rank, as device 0")
    opt("--page", default=None, metavar="[HOST:]PORT",
        help="serve a live page of the run (members, deaths, shrinks and grows, the store's "
             "load, each rank's recent collectives) and its data as JSON at "
             "http://HOST:PORT/ (HOST default 127.0.0.1; PORT 0: a free one, printed); beyond "
             "loopback it needs the job's store token (see docs/observability.md)")
    opt("--page-linger", type=float, default=0.0, metavar="S",
        help="keep serving the page's end state S seconds after the run ended (default 0)")
    opt("--local-addr", default=None, metavar="ADDR",
        help="the address other nodes reach this node at (default: the one it reaches the "
             "rendezvous store from)")
    opt("--signals-to-handle", default="SIGTERM,SIGINT,SIGHUP,SIGQUIT", metavar="SIG,...",
        help="signals forwarded to the workers before they are stopped "
             "(default SIGTERM,SIGINT,SIGHUP,SIGQUIT)")
    opt("--grace-period", "--shutdown-timeout", type=float, default=None, metavar="S",
        help="seconds between forwarding a signal (or SIGTERM) and SIGKILL (default: "
             "TORCH_ELASTIC_SHUTDOWN_TIMEOUT as torchrun reads it, else 5)")
    return p, takes_value, [s for a in p._actions for s in a.option_strings]


def _apply_env_defaults(parser: argparse.ArgumentParser) -> None:
    """torchrun reads each flag's default from ``PET_<DEST>`` (e.g. PET_NPROC_PER_NODE)."""
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        value = os.environ.get(f"PET_{action.dest.upper()}")
        if value is None:
            continue
        if action.nargs == 0:
            parser.set_defaults(**{action.dest: value.lower() in ("1", "true", "yes", "on")})
        else:
            parser.set_defaults(**{action.dest: value})


def _closest(flag: str, known: list[str]) -> str:
    match = difflib.get_close_matches(flag, known, n=1, cutoff=0.5)
    return f"; did you mean {match[0]}?" if match else "; see --help"


def split_argv(argv: Sequence[str], takes_value: set[str],
               known: list[str] | None = None) -> tuple[list[str], list[str]]:
    """Split into (launcher options, [entrypoint, *its args]); raise ValueError for an unknown
    option (naming the closest known one) when ``known`` is given.

    Done by hand because argparse's REMAINDER swallows a ``--`` that belongs to the script.
    """
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            return list(argv[:i]), list(argv[i + 1:])
        if not arg.startswith("-") or arg == "-":
            return list(argv[:i]), list(argv[i:])
        if not arg.startswith("--") and len(arg) > 2 and arg[:2] in takes_value:
            i += 1            # a short option with its value attached: -t3
            continue
        name = arg.split("=", 1)[0]
        if known is not None and name not in known:
            raise ValueError(f"unknown option {name}{_closest(name, known)}")
        i += 2 if arg in takes_value else 1   # "--flag=value" is one item
    return list(argv), []


def _nproc(text: str) -> int:
    if text == "cpu":
        return os.cpu_count() or 1
    if text in ("gpu", "auto"):
        gpus = _gpu_count()
        if gpus:
            return gpus
        if text == "gpu":
            raise ValueError("--nproc-per-node gpu: no GPU found on this node (no /dev/nvidia* "
                             "device); give a number, or cpu")
        # not XPUs: without torch we cannot tell whether its build drives them, and an i915
        # integrated GPU would turn auto's one-per-core into one worker
        return os.cpu_count() or 1
    if text == "xpu":
        xpus = _xpu_count()
        if not xpus:
            raise ValueError("--nproc-per-node xpu: no Intel GPU found on this node (no i915 or "
                             "xe device in /sys/class/drm); give a number, or cpu")
        return xpus
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"--nproc-per-node: {text!r} is not a number, auto, cpu, gpu or "
                         "xpu") from None


def _gpu_count() -> int:
    """GPUs on this node without importing torch: CUDA_VISIBLE_DEVICES, else /dev/nvidiaN."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    return len(glob.glob("/dev/nvidia[0-9]*"))


def _xpu_count() -> int:
    """Intel GPUs without importing torch: ``ZE_AFFINITY_MASK`` (Level Zero's device list),
    else the render nodes in /sys/class/drm driven by i915 or xe."""
    mask = os.environ.get("ZE_AFFINITY_MASK")
    if mask is not None:
        return len({d.strip().split(".")[0] for d in mask.split(",") if d.strip()})
    count = 0
    for node in glob.glob("/sys/class/drm/renderD*"):
        driver = os.path.basename(os.path.realpath(os.path.join(node, "device/driver")))
        count += driver in ("i915", "xe")
    return count


def parse_args(argv: Sequence[str] | None = None) -> LaunchConfig:
    """Parse a ``plugdist-run`` command line. Bad input exits with status 2 and a message."""
    parser, takes_value, known = build_parser()
    _apply_env_defaults(parser)
    raw = list(sys.argv[1:] if argv is None else argv)
    try:
        own, rest = split_argv(raw, takes_value, known)
    except ValueError as exc:
        parser.error(str(exc))
    ns = parser.parse_args(own)
    if not rest:
        parser.error("missing the script (or, with -m, the module) to run")
    try:
        return _config(ns, rest)
    except ValueError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits


# the job ids of the schedulers that start one launcher per node: every node of a job sees
# the same, and two jobs never do
_SCHEDULER_JOB_IDS = (("slurm", ("SLURM_JOB_ID", "SLURM_STEP_ID")), ("pbs", ("PBS_JOBID",)),
                      ("lsf", ("LSB_JOBID",)), ("flux", ("FLUX_JOB_ID",)),
                      ("cobalt", ("COBALT_JOBID",)))


def default_run_id(max_nodes: int, backend: str, endpoint: str, command: Sequence[str],
                   environ: Mapping[str, str]) -> str:
    """The run id when ``--rdzv-id`` is not given. One node: random. Several: the scheduler's
    job id where one is set (``slurm-<job>.<step>``, ``pbs-``, ``lsf-``, ``flux-``,
    ``cobalt-``), which every node of the job shares and no other job has; else a digest of
    what every node of one job is started with alike (the rendezvous backend and endpoint as
    given, ``--nnodes``' upper bound, the command and its arguments), so that another job on
    the same endpoint (another command, or another size) keeps to rounds of its own instead
    of joining these. Two launches of the very same command on one endpoint
    still share their rounds: give each its own ``--rdzv-id``."""
    if max_nodes == 1:
        return os.urandom(6).hex()
    for scheduler, names in _SCHEDULER_JOB_IDS:
        parts = [environ[n].strip() for n in names if environ.get(n, "").strip()]
        if parts and names[0] in environ:
            return _safe_id(f"{scheduler}-{'.'.join(parts)}")
    said = json.dumps([backend, endpoint, max_nodes, list(command)])
    return "cmd-" + hashlib.sha256(said.encode()).hexdigest()[:16]


def _safe_id(text: str) -> str:
    """``text`` as a key segment: letters, digits and ``-_.`` kept, the rest ``_``."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)[:64]


def _config(ns: argparse.Namespace, rest: list[str]) -> LaunchConfig:
    min_nodes, max_nodes = parse_nnodes(ns.nnodes)
    if ns.rdzv_backend not in ("static", "c10d"):
        from plugdist._registry import STORES, registry
        schemes = registry.names(STORES)
        if ns.rdzv_backend not in schemes:
            raise ValueError(f"--rdzv-backend {ns.rdzv_backend!r}: plugdist-run's rendezvous "
                             f"backends are static, c10d and every installed store scheme "
                             f"({', '.join(schemes)}); torchrun's etcd-v2 is not offered: "
                             f"pip install plugdist-etcd for --rdzv-backend etcd (v3 API), or "
                             f"use c10d, which needs no server")
        if not ns.rdzv_endpoint:
            raise ValueError(f"--rdzv-backend {ns.rdzv_backend} needs --rdzv-endpoint (the "
                             f"store's address, e.g. HOST:PORT,HOST:PORT for etcd)")
    backend, endpoint = ns.rdzv_backend, ns.rdzv_endpoint
    master_addr, master_port, node_rank = ns.master_addr, ns.master_port, ns.node_rank
    if ns.standalone:
        if max_nodes != 1 or (node_rank or 0) != 0:
            raise ValueError("--standalone is for a single node; drop --nnodes/--node-rank, or "
                             "drop --standalone and use --rdzv-backend c10d or --master-addr")
        if master_addr is not None or master_port is not None:
            raise ValueError("--standalone picks 127.0.0.1 and a free port itself; drop "
                             "--master-addr/--master-port, or drop --standalone")
        backend, endpoint = "static", ""
    if backend == "static":
        if endpoint:
            host, _, port = endpoint.rpartition(":")
            master_addr = master_addr or host
            master_port = master_port if master_port is not None else int(port)
        if node_rank is None:
            node_rank = 0   # torchrun's default; two nodes claiming 0 fail at rendezvous
        if max_nodes > 1 and master_port is None:
            master_port = DEFAULT_MASTER_PORT
    elif endpoint and backend == "c10d":
        host, sep, port = endpoint.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
            raise ValueError(f"--rdzv-endpoint {endpoint!r} is not HOST:PORT")
    run_id = ns.rdzv_id
    if run_id is None:
        run_id = default_run_id(max_nodes, backend, endpoint or f"{master_addr}:{master_port}",
                                rest, os.environ)
    rdzv = RendezvousOptions.parse(ns.rdzv_conf)
    ranks_filter = None
    if ns.local_ranks_filter.strip():
        try:
            ranks_filter = frozenset(int(r) for r in ns.local_ranks_filter.split(","))
        except ValueError:
            raise ValueError(f"--local-ranks-filter {ns.local_ranks_filter!r} is not a "
                             f"comma-separated list of local ranks") from None
    if ns.logs_specs not in (None, "", "default", "DefaultLogsSpecs"):
        raise ValueError(f"--logs-specs {ns.logs_specs!r}: plugdist-run does not load torchrun "
                         "LogsSpecs classes; it keeps its own log layout (--log-dir, -r, -t, "
                         "--duplicate-stdout-filters); drop --logs-specs or pass 'default'")
    if ns.numa_binding is not None and ns.numa_binding not in NUMA_MODES:
        raise ValueError(f"--numa-binding {ns.numa_binding!r} is not one of "
                         f"{', '.join(NUMA_MODES)}")
    grace = ns.grace_period
    if grace is None:
        text = os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "5")
        try:
            grace = float(text)
        except ValueError:
            raise ValueError(f"TORCH_ELASTIC_SHUTDOWN_TIMEOUT={text!r} is not a number of "
                             "seconds; fix it or pass --grace-period") from None
    if ns.page is not None:
        from plugdist._launcher.page import parse_address
        parse_address(ns.page)   # a malformed address is refused before anything starts
    entrypoint, args = rest[0], tuple(rest[1:])
    if not ns.module and not ns.no_python and not os.path.isfile(entrypoint):
        raise ValueError(f"script {entrypoint!r} not found (cwd {os.getcwd()}); pass -m to run a "
                         "module, or --no-python to run an executable")
    return LaunchConfig(
        entrypoint=entrypoint, args=args, nproc_per_node=_nproc(ns.nproc_per_node),
        min_nodes=min_nodes, max_nodes=max_nodes, node_rank=node_rank,
        master_addr=master_addr, master_port=master_port, rdzv_backend=backend,
        rdzv_endpoint=endpoint, run_id=run_id, rdzv=rdzv, standalone=ns.standalone,
        max_restarts=ns.max_restarts, replace_failed=ns.replace_failed,
        monitor_interval=timedelta(seconds=ns.monitor_interval),
        start_method=ns.start_method, role=ns.role, log_dir=ns.log_dir,
        redirects=parse_streams(ns.redirects, "--redirects"), tee=parse_streams(ns.tee, "--tee"),
        rank_prefix=ns.rank_prefix, local_ranks_filter=ranks_filter, local_addr=ns.local_addr,
        signals_to_handle=parse_signals(ns.signals_to_handle),
        grace_period=timedelta(seconds=grace), module=ns.module,
        no_python=ns.no_python, run_path=ns.run_path,
        duplicate_stdout_filters=parse_filters(ns.duplicate_stdout_filters),
        duplicate_stderr_filters=parse_filters(ns.duplicate_stderr_filters),
        numa_binding=ns.numa_binding, virtual_local_rank=ns.virtual_local_rank,
        page=ns.page, page_linger=ns.page_linger)
