"""gpu-kinfer-bridge: a LAKE-style inference service over shared memory, with LinnOS.

Over 800 lines because the command has fourteen subcommands (the daemon, its producers, model
training, loading and calibration, replay, eBPF capture, the feature store) sharing one app and
its options; each is options and calls into gpuos_tools.kinfer.
"""

from __future__ import annotations

import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

import typer

from gpuos_tools.commands.cli import OutputOpt, UnbufferedOpt, run_app
from gpuos_tools.errors import ExitCode, GpuosError
from gpuos_tools.kinfer import records as _schemas  # noqa: F401 -- registers the schemas of what it writes
from gpuos_tools.kinfer.bpf import OBJECT
from gpuos_tools.stream import make_header, open_input, open_output
from gpuos_tools.units import parse_duration

# gpuos_tools.kinfer's other modules load numpy: each subcommand imports those it uses, so that
# --help and the light subcommands do not pay for it.

# The daemon's CPU path runs small batches on one core next to a spinning loop: BLAS threads
# only fight it, and make a small batch many times slower. Set before numpy is first imported;
# an explicit setting wins.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

app = typer.Typer(
    name="gpu-kinfer-bridge",
    add_completion=False,
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
    short_help="a LAKE-style inference service over shared memory, with LinnOS",
    help="A LAKE-style inference service over shared memory: producers in any language put "
    "feature vectors into a ring, a daemon batches them and runs the model on the CPU or the "
    "GPU, as measured, and answers each. LinnOS (slow-read prediction with hedging) is the "
    "model it ships with.",
)
features_app = typer.Typer(help="LAKE's feature store: register a schema, record vectors, read a window.")
app.add_typer(features_app, name="features")

ProfileOpt = typer.Option(
    None, "--profile", "-p", metavar="NAME|FILE",
    help="Profile: a TOML file, or a NAME: your own ~/.config/gpuos-tools/profiles/NAME.toml, else the one installed "
    "with the package (linnos).",
)
RingOpt = typer.Option(None, "--ring", "-r", metavar="NAME", help="Ring name (/dev/shm/NAME); default: the profile's.")
RingOwnerOpt = typer.Option(None, "--ring-owner", metavar="USER", help="Also trust a ring of this user (a daemon of "
                            "another user sharing its ring); otherwise only this user's and root's rings are used.")


def _ring_owner(user: str | None) -> int | None:
    """A user name or uid, as given to --ring-owner, to a uid."""
    import pwd

    if user is None:
        return None
    if user.isdigit():
        return int(user)
    try:
        return pwd.getpwnam(user).pw_uid
    except KeyError:
        raise typer.BadParameter(f"no user named {user!r}", param_hint="--ring-owner") from None



def _load_model(path: str) -> Any:
    from gpuos_tools.kinfer.model import Mlp

    if not os.path.exists(path):
        raise GpuosError(f"{path}: no such model file (gpu-kinfer-bridge train writes one)", ExitCode.NO_INPUT)
    try:
        return Mlp.load(path)
    except ValueError as e:
        raise GpuosError(str(e), ExitCode.BAD_INPUT) from None


def _read_trace(path: str) -> list[dict[str, Any]]:
    from gpuos_tools.kinfer.traces import io_records

    with open_input(path) as reader:
        try:
            records = list(io_records(reader))
        except ValueError as e:
            raise GpuosError(f"{path}: {e}", ExitCode.BAD_INPUT) from None
    if not records:
        raise GpuosError(f"{path}: no io records", ExitCode.BAD_INPUT)
    return records



def _measured(value: float, digits: int) -> float | None:
    """A speed estimate for the stats record: null while a failed batch in the window makes it
    infinite (JSON has no infinity)."""
    return round(value, digits) if math.isfinite(value) else None

@app.command()
def serve(
    profile: Optional[str] = ProfileOpt,
    ring: Optional[str] = RingOpt,
    model: Optional[str] = typer.Option(None, "--model", "-m", metavar="FILE", help="Model file (.npz); default: the profile's."),
    random_model: Optional[int] = typer.Option(
        None, "--random-model", metavar="SEED", help="Serve random weights of the profile's shape (benchmarks, tests)."
    ),
    gpu: str = typer.Option("auto", "--gpu", metavar="auto|on|off", help="auto: the GPU when CuPy and a GPU are there; on: fail without."),
    device: int = typer.Option(0, "--device", help="GPU index."),
    window_us: Optional[float] = typer.Option(None, "--window-us", min=0.0, max=1e6, help="Batching window (µs); default: the profile's."),
    max_batch: Optional[int] = typer.Option(None, "--max-batch", min=1, max=1 << 20, help="Largest batch; default: the profile's."),
    spin_us: Optional[float] = typer.Option(
        None, "--spin-us", min=0.0, max=1e7,
        help="Spin exactly this long on an empty ring before sleeping; default: adaptive (see WAITING).",
    ),
    spin_max_us: Optional[float] = typer.Option(
        None, "--spin-max-us", min=0.0, max=1e7,
        help="Adaptive waiting: the longest spin (µs); default: the profile's [wait] spin_max_us.",
    ),
    native: Optional[str] = typer.Option(
        None, "--native", metavar="auto|on|off",
        help="The C serve loop for small CPU batches (built once with cc); auto: used when it builds; default: the profile's.",
    ),
    recreate: bool = typer.Option(False, "--recreate", help="Replace an existing ring of this user (another geometry, "
                                  "or a damaged one) that no daemon serves; any other file is refused."),
    mode: Optional[str] = typer.Option(None, "--mode", metavar="OCTAL", help="Permission bits of the ring file "
                                       "(default: the profile's, 0600: this user only; 0660 with --group shares it)."),
    group: Optional[str] = typer.Option(None, "--group", metavar="GROUP", help="Give the ring file to this group "
                                        "(name or number) so that its members may produce (with --mode 0660)."),
    model_dir: Optional[list[str]] = typer.Option(None, "--model-dir", metavar="DIR", help="Take model-load requests "
                                                  "(gpu-kinfer-bridge load) only for regular files inside DIR (repeat "
                                                  "for several); default: the profile's, else the served model's "
                                                  "directory when no one else may write it."),
    output: OutputOpt = "-",
    unbuffered: UnbufferedOpt = False,
) -> None:
    """Serve inference requests from the ring until SIGTERM or SIGINT.

    Creates the ring (or attaches to the one a previous daemon of this user left, keeping its
    producers), then answers every request. At exit writes one `kinfer_stats` record (the
    ring's counters) to the output; messages go to stderr.
    """
    from gpuos_tools.kinfer import ring as R
    from gpuos_tools.kinfer.model import Mlp
    from gpuos_tools.kinfer.policy import load_profile, parse_mode
    from gpuos_tools.kinfer.server import RingServer, ServeOptions, default_model_dirs

    if gpu not in ("auto", "on", "off"):
        raise typer.BadParameter("must be auto, on or off", param_hint="--gpu")
    if mode is not None:
        try:
            parse_mode(mode)
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="--mode") from None
    prof = load_profile(profile)
    ns = prof.section("native")
    native_mode = str(ns["mode"]) if native is None else native
    if native_mode not in ("auto", "on", "off"):
        raise typer.BadParameter("must be auto, on or off", param_hint="--native")
    shape = prof.section("model")
    if random_model is not None:
        mlp = Mlp.random(int(shape["inputs"]), int(shape["hidden"]), int(shape["outputs"]), random_model)
        path = None
    else:
        path = model or (str(prof.model_file()) if prof.model_file() else None)
        if path is None:
            raise GpuosError("no model: give --model FILE (or --random-model SEED), or set [model] file in the profile", ExitCode.USAGE)
        if model is None and not os.path.exists(path):
            raise GpuosError(f"the profile's model {path} does not exist: train one (gpu-kinfer-bridge train TRACE "
                             "--model FILE) and give --model FILE", ExitCode.NO_INPUT)
        mlp = _load_model(path)
    rs, bs = prof.section("ring"), prof.section("batch")
    geometry = R.Geometry(int(rs["lanes"]), int(rs["slots_per_lane"]), max(32, mlp.n_inputs), max(4, mlp.n_outputs))
    try:
        R.check_geometry(geometry)
    except ValueError as e:
        raise GpuosError(f"ring geometry: {e}", ExitCode.USAGE) from None
    load_dir = shape["load_dir"]
    if model_dir:
        dirs = tuple(model_dir)
    elif load_dir:
        dirs = (str(prof.relative(load_dir)),)
    else:
        dirs = default_model_dirs(path)
    for d in dirs:
        if not os.path.isdir(d):
            raise GpuosError(f"{d}: no such directory (--model-dir)", ExitCode.USAGE)
    ws = prof.section("wait")
    spin_min = float(ws["spin_min_us"])
    spin_max = float(ws["spin_max_us"] if spin_max_us is None else spin_max_us)
    for value, hint in ((spin_us, "--spin-us"), (spin_max, "--spin-max-us"), (spin_min, "[wait] spin_min_us")):
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise typer.BadParameter("must be a finite number of µs, 0 or more", param_hint=hint)
    opts = ServeOptions(
        window_us=float(bs["window_us"] if window_us is None else window_us),
        max_batch=int(bs["max"] if max_batch is None else max_batch),
        spin_us=spin_us, spin_min_us=spin_min, spin_max_us=max(spin_min, spin_max),
        use_gpu=gpu, device=device, native=native_mode, native_max=int(ns["max_batch"]),
        mode=parse_mode(rs["mode"] if mode is None else mode), group=(rs["group"] or None) if group is None else group,
        model_dirs=dirs,
    )
    name = ring or str(rs["name"])
    server = RingServer.open(name, geometry, mlp, prof.policy(), opts, recreate=recreate)
    if not dirs:
        print("gpu-kinfer-bridge: model loads are off (no --model-dir, and the model's directory is not private to "
              "this user)", file=sys.stderr, flush=True)
    try:
        server.install_signals()
        where = "CPU and GPU" if server.gpu_ready else "CPU only"
        loop = f"native loop for CPU batches up to {opts.native_max}" if server.native is not None else "Python loop"
        print(
            f"gpu-kinfer-bridge: serving {server.ring.path} (pid {os.getpid()}, {geometry.lanes} lanes x "
            f"{geometry.slots_per_lane} slots, {where}, {loop})", file=sys.stderr, flush=True,
        )
        t0 = time.monotonic()
        server.serve()
        stats = {"type": "kinfer_stats", "ring": str(server.ring.path), "seconds": round(time.monotonic() - t0, 3),
                 **server.ring.counter_values(), "native": server.native is not None,
                 **(server.native.stats() if server.native is not None else {}),
                 "gpu_delay_us": _measured(server.speed.delay_us(), 3), "gpu_probes": server.speed.probes,
                 "cpu_extra_us": _measured(server.cpu_speed.fit()[0], 3),
                 "cpu_scale": _measured(server.cpu_speed.fit()[1], 4),
                 "cpu_slowdown": _measured(server.cpu_speed.slowdown(), 4)}
        stats["ring_repairs"] = server.repairs
        failure = server.failure
    finally:
        server.close()
    with open_output(output, unbuffered=unbuffered or None) as writer:
        writer.write(make_header("gpu-kinfer-bridge", ring=name))
        writer.write(stats)
    if failure:
        raise GpuosError(failure, ExitCode.FAILURE)


@app.command()
def status(
    ring: Optional[str] = RingOpt,
    profile: Optional[str] = ProfileOpt,
    ring_owner: Optional[str] = RingOwnerOpt,
    wait: Optional[str] = typer.Option(
        None, "--wait", metavar="DURATION",
        help="Wait up to DURATION (30s, 500ms) for a live daemon on the ring before answering, as a script "
        "does after starting `serve` in the background; exit 66 if none comes.",
    ),
    output: OutputOpt = "-",
) -> None:
    """Write one `kinfer_status` record: the ring's geometry, daemon and counters."""
    from gpuos_tools.kinfer import ring as R
    from gpuos_tools.kinfer.policy import load_profile

    owner = _ring_owner(ring_owner)
    name = ring or str(load_profile(profile).section("ring")["name"])
    owners = None if owner is None else (os.geteuid(), 0, owner)
    if wait is None:
        r = R.Ring.attach(name, owners=owners)
    else:
        try:
            limit = parse_duration(wait)
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="--wait") from None
        r = _wait_for_daemon(name, limit, owners)
    try:
        h = r.header
        g = r.geometry
        slots = {R.STATE_NAMES.get(s, str(s)): int((r.state == s).sum()) for s in {int(v) for v in r.state}}
        rec = {
            "type": "kinfer_status", "ring": str(r.path), "version": int(h["version"]), "lanes": g.lanes,
            "slots_per_lane": g.slots_per_lane, "max_inputs": g.max_inputs, "max_outputs": g.max_outputs,
            "daemon_pid": int(h["daemon_pid"]), "daemon_alive": r.daemon_alive(), "daemon_epoch": int(h["daemon_epoch"]),
            "model_generation": int(h["model_generation"]), "slots": slots, "counters": r.counter_values(),
        }
        del h
    finally:
        r.close()
    with open_output(output) as writer:
        writer.write(make_header("gpu-kinfer-bridge", ring=name))
        writer.write(rec)


def _wait_for_daemon(name: str, limit: float, owners: tuple[int, ...] | None = None) -> Any:
    """The ring once a live daemon serves it, polled every 20 ms for ``limit`` seconds."""
    from gpuos_tools.kinfer import ring as R

    deadline = time.monotonic() + limit
    while True:
        try:
            r = R.Ring.attach(name, owners=owners)
        except R.RingError as e:
            # missing, or made by a daemon that has not written its header yet (the tour's
            # `serve &` then `status --wait` caught one so on a loaded machine): wait
            if not (e.code == ExitCode.NO_INPUT or e.unready) or time.monotonic() >= deadline:
                raise
        else:
            if r.daemon_alive():
                return r
            r.close()
            if time.monotonic() >= deadline:
                raise GpuosError(f"{R.ring_path(name)}: no live daemon after {limit:g} s", ExitCode.NO_INPUT)
        time.sleep(0.02)


@app.command()
def infer(
    input: str = typer.Argument("-", metavar="[INPUT]", help="Stream of records with an `x` list of numbers ('-' = stdin)."),
    ring: Optional[str] = RingOpt,
    profile: Optional[str] = ProfileOpt,
    model_id: int = typer.Option(0, "--model-id", help="Model to ask (0: the daemon's default)."),
    timeout: float = typer.Option(5.0, "--timeout", min=0.0, help="Seconds to wait for each answer."),
    ring_owner: Optional[str] = RingOwnerOpt,
    output: OutputOpt = "-",
    unbuffered: UnbufferedOpt = False,
) -> None:
    """The Python client as a filter: each record with an `x` field is sent to the daemon and
    followed by a `kinfer_answer` record (status, decision, outputs, batch, where, latency_us);
    every other record passes through."""
    from gpuos_tools.kinfer import ring as R
    from gpuos_tools.kinfer.policy import load_profile

    owner = _ring_owner(ring_owner)
    name = ring or str(load_profile(profile).section("ring")["name"])
    with R.RingClient(name, owner=owner) as client, open_input(input) as reader, open_output(output, unbuffered=unbuffered or None) as writer:
        if reader.header is None:
            writer.write(make_header("gpu-kinfer-bridge", ring=name))
        for rec in reader:
            writer.write(_json_record(rec))
            if "x" not in rec or rec["type"] == "header":
                continue
            try:
                answer = client.infer(rec["x"], model_id, timeout)
            except (ValueError, TypeError) as e:
                writer.write({"type": "error", "message": f"x: {e}"})
                continue
            writer.write({
                "type": "kinfer_answer", "status": R.STATUS_NAMES.get(answer.status, answer.status),
                "decision": answer.decision, "outputs": [_json_number(v) for v in answer.outputs.tolist()],
                "batch": answer.batch, "where": "gpu" if answer.where == R.GPU else "cpu",
                "latency_us": round(answer.latency_ns / 1e3, 3),
            })


def _json_record(rec: dict[str, Any]) -> dict[str, Any]:
    """A record passed through, its `x` as JSON has it: NaN and infinities (which the reader
    accepts, as Python's json does) are not JSON numbers, so they are written as null; the
    answer after the record says the daemon refused it (bad_value)."""
    x = rec.get("x")
    if isinstance(x, list) and any(isinstance(v, float) and not math.isfinite(v) for v in x):
        # the same class: a record of another tool's type stays one passed through (stream.records.Passed)
        return type(rec)({**rec, "x": [_json_number(v) if isinstance(v, float) else v for v in x]})
    return rec


def _json_number(value: float) -> float | None:
    """A number for JSON: NaN and infinities are not JSON numbers, so they become null."""
    return round(value, 6) if math.isfinite(value) else None


@app.command()
def load(
    model: str = typer.Argument(..., metavar="MODEL", help="Model file (.npz) to swap in."),
    ring: Optional[str] = RingOpt,
    profile: Optional[str] = ProfileOpt,
    model_id: int = typer.Option(0, "--model-id", min=0, max=63, help="Which model to replace or add (0: the default; up to 63)."),
    timeout: float = typer.Option(30.0, "--timeout", min=0.0, help="Seconds to wait for the daemon to take it."),
    ring_owner: Optional[str] = RingOwnerOpt,
) -> None:
    """Swap a model into the running daemon without restarting it.

    The daemon loads the file in a thread and swaps it in between two batches; requests
    already being answered finish on the old model. The file is checked here first; the daemon
    takes only regular files inside its model directories (`serve --model-dir`).
    """
    from gpuos_tools.kinfer import ring as R
    from gpuos_tools.kinfer.policy import load_profile
    from gpuos_tools.kinfer.server import request_load

    _load_model(model)
    owner = _ring_owner(ring_owner)
    name = ring or str(load_profile(profile).section("ring")["name"])
    code = request_load(name, model, model_id, timeout, owner=owner)
    if code != 0:
        why = R.CONTROL_NAMES.get(code, f"status {code}")
        raise GpuosError(f"the daemon refused {model}: {why} (its stderr says more)", ExitCode.FAILURE)
    print(f"gpu-kinfer-bridge: model {model_id} is now {model}", file=sys.stderr)


@app.command()
def calibrate(
    profile: str = typer.Option(
        "linnos", "--profile", "-p", metavar="NAME|FILE",
        help="Profile to measure for and update (a profile installed with the package is copied to "
        "~/.config/gpuos-tools/profiles/ and the copy updated).",
    ),
    batches: str = typer.Option("1,2,4,8,16,32,64,128,256,512,1024,2048,4096", "--batches", help="Batch sizes, comma-separated."),
    reps: int = typer.Option(50, "--reps", help="Timed runs per batch size (median kept)."),
    device: int = typer.Option(0, "--device", help="GPU index."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Measure and report; leave the profile as it is."),
    output: OutputOpt = "-",
) -> None:
    """Measure CPU and GPU latency of the profile's model across batch sizes and write the
    curves and the crossover into the profile.

    GPU time covers what the daemon pays per batch: copy in, run, copy out, synchronise.
    Without a GPU only the CPU curve is measured and the profile is left unchanged. Writes one
    `kinfer_calibration` record.
    """
    from gpuos_tools.kinfer import calibrate as cal
    from gpuos_tools.kinfer.policy import is_shipped, load_profile, user_profile_dir, write_profile

    try:
        sizes = sorted({int(b) for b in batches.split(",") if b.strip()})
    except ValueError:
        raise typer.BadParameter("comma-separated integers", param_hint="--batches") from None
    if not sizes or sizes[0] < 1:
        raise typer.BadParameter("batch sizes must be positive", param_hint="--batches")
    prof = load_profile(profile)
    result = cal.measure(prof, sizes, reps, device)
    if result["gpu_error"]:
        print(f"gpu-kinfer-bridge: GPU not measured: {result['gpu_error']}", file=sys.stderr)
    if not dry_run and result["gpu_us"] and prof.path is not None:
        data = cal.updated_profile(prof, result)
        target = prof.path
        if is_shipped(target):  # never rewrite the installed package: the user's own copy
            target = user_profile_dir() / target.name
            target.parent.mkdir(parents=True, exist_ok=True)
            model = data.get("model", {}).get("file")
            if model and not Path(model).is_absolute():  # the model stays the one it named
                data["model"]["file"] = str(prof.path.parent / model)
        write_profile(target, data, cal.PROFILE_COMMENT)
        print(f"gpu-kinfer-bridge: {target}: crossover {result['crossover']}"
              + (f" (the installed {prof.path.name} is unchanged; --profile {target.stem} now finds this one)"
                 if target != prof.path else ""), file=sys.stderr)
    with open_output(output) as writer:
        writer.write(make_header("gpu-kinfer-bridge", profile=str(prof.path)))
        writer.write({"type": "kinfer_calibration", **result})


@app.command()
def train(
    trace: Optional[str] = typer.Argument(None, metavar="[TRACE]", help="An io trace (collect or synth; '-' = stdin)."),
    model: str = typer.Option(..., "--model", "-m", metavar="FILE", help="Where to write the model (.npz, atomically)."),
    features: Optional[str] = typer.Option(
        None, "--features", metavar="STORE", help="Train on a LinnOS feature store (features capture) instead of a trace."
    ),
    last_s: Optional[float] = typer.Option(None, "--last-s", help="With --features: only the last this many seconds."),
    label: str = typer.Option("inflection", "--label", metavar="inflection|percentile", help="How slow reads are told from fast."),
    percentile: float = typer.Option(90.0, "--percentile", help="With --label percentile: slow above this percentile."),
    epochs: int = typer.Option(20, "--epochs", help="Passes over the training reads."),
    slow_weight: float = typer.Option(5.0, "--slow-weight", help="Loss weight of slow reads (predicted fast)."),
    seed: int = typer.Option(0, "--seed", help="Initialisation and shuffling seed."),
    output: OutputOpt = "-",
) -> None:
    """Train the LinnOS model on a trace or a feature-store window; write it and a
    `kinfer_train` report record."""
    from gpuos_tools.kinfer.linnos import FEATURE_FIELDS, train_arrays, train_trace

    if label not in ("inflection", "percentile"):
        raise typer.BadParameter("inflection or percentile", param_hint="--label")
    if (trace is None) == (features is None):
        raise typer.BadParameter("give a TRACE or --features STORE (one of them)", param_hint="--features")
    kwargs = {"label": label, "percentile": percentile, "epochs": epochs, "slow_weight": slow_weight, "seed": seed}
    source = trace or f"features:{features}"
    try:
        if features is not None:
            from gpuos_tools.kinfer.features import FeatureStore

            store = FeatureStore.open(features)
            try:
                if store.fields != FEATURE_FIELDS:
                    raise GpuosError(f"{features}: not a LinnOS feature store ({len(store.fields)} fields)", ExitCode.BAD_INPUT)
                since = 0 if last_s is None else max(0, time.monotonic_ns() - int(last_s * 1e9))
                _, _, values = store.window(since)
            finally:
                store.close()
            mlp, report = train_arrays(values[:, :-1], values[:, -1].astype("float64"), **kwargs)
        else:
            mlp, report = train_trace(_read_trace(trace), **kwargs)
    except ValueError as e:
        raise GpuosError(f"{source}: {e}", ExitCode.BAD_INPUT) from None
    mlp.meta["trace"] = source
    mlp.save(model)
    report["model"] = model
    with open_output(output) as writer:
        writer.write(make_header("gpu-kinfer-bridge", source=source))
        writer.write(report)


def _spawn_daemon(model: str, gpu: str) -> tuple[subprocess.Popen[bytes], str]:
    """A daemon of our own on a private ring, for replay without --ring: this command's `serve`,
    whose profile, model and option handling is the command's, not the library's."""
    from gpuos_tools.kinfer import ring as R

    name = f"gpuos-kinfer-replay-{os.getpid()}"
    root = str(Path(__file__).resolve().parent.parent.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p))
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpuos_tools.commands.kinfer", "serve", "--ring", name, "--model", model,
         "--gpu", gpu, "--recreate", "-o", os.devnull],
        env=env, stdin=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise GpuosError(f"the replay daemon exited with status {proc.returncode}", ExitCode.FAILURE)
        if R.served_by(name, proc.pid):
            return proc, name
        time.sleep(0.02)
    proc.terminate()
    raise GpuosError("the replay daemon did not start within 60 s", ExitCode.FAILURE)


@app.command()
def replay(
    trace: str = typer.Argument(..., metavar="TRACE", help="An io trace with reads on at least two devices."),
    model: str = typer.Option(..., "--model", "-m", metavar="FILE", help="The LinnOS model (its threshold labels the oracle)."),
    ring: Optional[str] = typer.Option(
        None, "--ring", "-r", metavar="NAME", help="Use the daemon serving this ring (it must serve MODEL); default: start one."
    ),
    gpu: str = typer.Option("off", "--gpu", metavar="auto|on|off", help="For the daemon replay starts itself."),
    reroute_us: float = typer.Option(0.0, "--reroute-us", help="Extra cost of sending a read to the replica (µs)."),
    replica: str = typer.Option(
        "next", "--replica", metavar="next|shifted",
        help="next: the trace's next device serves a rerouted read; shifted: for one disk, a model of an identical independent replica (the same disk half the trace later).",
    ),
    probes: int = typer.Option(500, "--probes", help="Round trips measured to charge each LinnOS read."),
    output: OutputOpt = "-",
) -> None:
    """Replay a trace's reads through the bridge with hedging (a read predicted slow goes to
    the replica); write a `kinfer_replay` record: avg, p50, p99, p99.9 read latency with no
    prediction, with LinnOS and with an oracle.

    Each LinnOS read is charged the bridge's round trip as measured here after the replay:
    the median of --probes sequential requests sent at the trace's median gap between reads
    (so the daemon waits between them as it would for that traffic). The record's
    `inference` says what was charged and how; stderr says it too."""
    import numpy as np

    from gpuos_tools.kinfer import ring as R
    from gpuos_tools.kinfer.linnos import replay as run_replay

    if replica not in ("next", "shifted"):
        raise typer.BadParameter("next or shifted", param_hint="--replica")
    if probes < 1:
        raise typer.BadParameter("at least 1", param_hint="--probes")
    mlp = _load_model(model)
    thr = mlp.meta.get("threshold_us")
    if thr is None:
        raise GpuosError(f"{model}: no threshold_us in the model (train it with gpu-kinfer-bridge train)", ExitCode.BAD_INPUT)
    records = _read_trace(trace)
    read_t = np.sort(np.array([float(r["t_us"]) for r in records if r["op"] == "R"]))
    # the pace of the probes: the trace's median gap between reads, at most 10 ms (the probes
    # then take at most probes x 10 ms)
    pace_s = min(0.01, float(np.median(np.diff(read_t))) / 1e6) if read_t.size > 1 else 0.0
    proc = None
    name = ring
    if name is None:
        proc, name = _spawn_daemon(model, gpu)
    probe_us: list[float] = []
    try:
        with R.RingClient(name) as client:
            depth = client.ring.geometry.slots_per_lane

            def decide(x: np.ndarray) -> np.ndarray:
                out = np.empty(len(x), dtype=np.int64)
                for start in range(0, len(x), depth):
                    tickets = [client.submit(row) for row in x[start : start + depth]]
                    for k, t in enumerate(tickets):
                        a = client.wait(t)
                        if not a.ok:
                            raise GpuosError(f"the daemon refused read {start + k}: {R.STATUS_NAMES.get(a.status)}", ExitCode.FAILURE)
                        out[start + k] = a.decision
                perf = time.perf_counter
                for k in range(probes):  # the round trip charged to every read, at the trace's pace
                    row = x[k % len(x)]
                    due = perf() + pace_s
                    if pace_s > 0.001:
                        time.sleep(pace_s)
                    while perf() < due:
                        pass
                    t0 = time.perf_counter_ns()
                    client.infer(row)
                    probe_us.append((time.perf_counter_ns() - t0) / 1e3)
                return out

            try:
                report = run_replay(records, decide, float(thr), reroute_us=reroute_us,
                                    inference_us=0.0, replica=replica)
            except ValueError as e:
                raise GpuosError(f"{trace}: {e}", ExitCode.BAD_INPUT) from None
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
            R.ring_path(name).unlink(missing_ok=True)
    inference = float(np.median(probe_us)) if probe_us else 0.0
    # charge the measured round trip to every LinnOS read (the replay itself ran pipelined)
    for key in ("avg", "p50", "p99", "p99.9", "max"):
        report["linnos"][key] += inference
    report["inference_us"] = round(inference, 3)
    report["inference"] = {
        "charged_us": round(inference, 3), "p99_us": round(float(np.percentile(probe_us, 99)), 3) if probe_us else None,
        "requests": len(probe_us), "pace_us": round(pace_s * 1e6, 3),
        "how": "median round trip of sequential batch-1 requests from this client to the daemon, sent at the trace's "
               "median gap between reads, measured after the replay; added to every LinnOS read (linnos_uncharged: without it)",
    }
    report["model"] = model
    # the figure the record carries, rounded once: the unrounded one can round the other way
    print(f"gpu-kinfer-bridge: each LinnOS read charged {report['inference']['charged_us']:.1f} us, the median round trip of {len(probe_us)} requests "
          f"measured here at the trace's pace ({pace_s * 1e6:.0f} us apart; p99 {report['inference']['p99_us']} us)",
          file=sys.stderr)
    with open_output(output) as writer:
        writer.write(make_header("gpu-kinfer-bridge", source=trace, ring=name))
        writer.write(report)


@app.command()
def synth(
    ios: int = typer.Option(100_000, "--ios", "-n", help="I/Os to generate (reads and writes)."),
    seed: int = typer.Option(0, "--seed", help="Random seed: the same seed gives the same trace."),
    devices: int = typer.Option(2, "--devices", help="Devices (a read can be hedged to the next one)."),
    rate: float = typer.Option(8000.0, "--rate", help="I/Os per second per device (Poisson)."),
    read_fraction: float = typer.Option(0.7, "--read-fraction", help="Share of reads."),
    gc_period_ms: float = typer.Option(100.0, "--gc-period-ms", help="Period of the slow (GC) phases."),
    gc_duty: float = typer.Option(0.1, "--gc-duty", help="Share of each period spent slow."),
    gc_slowdown: float = typer.Option(8.0, "--gc-slowdown", help="Service time multiplier while slow."),
    output: OutputOpt = "-",
) -> None:
    """Generate a synthetic block-I/O trace: Poisson arrivals, log-normal sizes, periodic slow
    phases standing for garbage collection."""
    from gpuos_tools.kinfer.traces import synthesize

    if devices < 1 or ios < 1:
        raise typer.BadParameter("must be positive", param_hint="--ios/--devices")
    params = {"devices": devices, "rate_per_s": rate, "read_fraction": read_fraction, "gc_period_ms": gc_period_ms,
              "gc_duty": gc_duty, "gc_slowdown": gc_slowdown}
    with open_output(output) as writer:
        writer.write(make_header("gpu-kinfer-bridge", trace="synthetic", seed=seed, **params))
        writer.write_many(synthesize(ios, seed=seed, **params))


_PROGRAM = typer.Argument(
    None, metavar="[-- PROGRAM [ARGS]...]",
    help="With --source ebpf: run this program and stop when it exits (its stdout goes to stderr).",
)


def _disks(specs: list[str] | None, directory: str | None) -> list[int]:
    """Kernel numbers of the disks named by --disk (or the one under --dir)."""
    from gpuos_tools.kinfer.bpf.collect import resolve_disk

    named = list(specs or []) or ([directory] if directory else [])
    try:
        return sorted({resolve_disk(spec) for spec in named})
    except ValueError as e:
        raise GpuosError(str(e), ExitCode.USAGE) from None


def _stop_on_signals() -> Any:
    """An event set by SIGTERM/SIGINT/SIGHUP (a capture then ends cleanly, its records kept)."""
    import signal
    import threading

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    return stop


@app.command(context_settings={"allow_interspersed_args": False})
def collect(
    source: str = typer.Option("direct", "--source", metavar="direct|ebpf",
                               help="direct: time O_DIRECT I/O issued here, from user space; ebpf: record what the kernel's block layer sees."),
    directory: Optional[str] = typer.Option(
        None, "--dir", "-d", metavar="DIR",
        help="Put test files here and run O_DIRECT reads and writes on them (needed with direct; with ebpf, a load to trace). On the disk to measure: tmpfs measures memory.",
    ),
    reads: Optional[int] = typer.Option(None, "--reads", "-n", help="Stop after this many reads (direct: default 20000, shared evenly among the devices)."),
    devices: int = typer.Option(2, "--devices", help="Files, each standing for one device."),
    depth: int = typer.Option(4, "--depth", help="Threads (outstanding I/Os) per file."),
    size_mib: int = typer.Option(256, "--size-mib", help="Size of each file."),
    write_fraction: float = typer.Option(0.2, "--write-fraction", help="Share of writes."),
    seed: int = typer.Option(0, "--seed", help="Seed of offsets and sizes."),
    disk: Optional[list[str]] = typer.Option(
        None, "--disk", metavar="DISK", help="ebpf: a disk to record (vda, /dev/vda, 254:0, or a path on it; repeat); default: the disk under --dir, else every disk.",
    ),
    seconds: Optional[float] = typer.Option(None, "--seconds", help="ebpf: stop after this long."),
    ring: Optional[str] = typer.Option(None, "--ring", "-r", metavar="NAME", help="ebpf: also ask the daemon serving this ring for each read's decision."),
    program: Optional[list[str]] = _PROGRAM,
    output: OutputOpt = "-",
    unbuffered: UnbufferedOpt = False,
) -> None:
    """Collect a real block-I/O trace: `io` records with the pending I/Os at issue and the
    latency of each.

    `--source direct` (the default) issues O_DIRECT reads and writes on files in --dir and
    times them from user space. `--source ebpf` loads a BPF program on the block layer (root)
    and records every read and write the kernel sends to the chosen disks, whoever issues them,
    with LinnOS's 31 inputs as the kernel computed them at issue (`x`), until PROGRAM exits,
    --seconds, --reads, or SIGINT/SIGTERM; with --dir it also runs the direct load as a
    workload. See EBPF PRODUCER.
    """
    if source not in ("direct", "ebpf"):
        raise typer.BadParameter("direct or ebpf", param_hint="--source")
    for value, hint in ((reads, "--reads"), (seconds, "--seconds")):
        if value is not None and not value > 0:
            raise typer.BadParameter("must be positive", param_hint=hint)
    if source == "direct":
        if directory is None:
            raise typer.BadParameter("--source direct needs a directory for its test files", param_hint="--dir")
        if program or disk or seconds or ring:
            raise typer.BadParameter("PROGRAM, --disk, --seconds and --ring go with --source ebpf", param_hint="--source")
        _collect_direct(directory, reads or 20_000, devices, depth, size_mib, write_fraction, seed, output)
        return
    _collect_ebpf(directory, reads, devices, depth, size_mib, write_fraction, seed, disk, seconds, ring, program, output, unbuffered)


def _collect_direct(directory: str, reads: int, devices: int, depth: int, size_mib: int, write_fraction: float, seed: int,
                    output: str) -> None:
    from gpuos_tools.kinfer.traces import collect as run

    if devices < 1 or depth < 1:
        raise typer.BadParameter("must be at least 1", param_hint="--devices/--depth")
    if reads < devices:
        raise typer.BadParameter(f"at least one read per device ({devices})", param_hint="--reads")
    try:
        records = run(directory, reads, devices=devices, depth=depth, file_size=size_mib << 20,
                      write_fraction=write_fraction, seed=seed)
    except OSError as e:
        raise GpuosError(f"{directory}: {e.strerror or e} (O_DIRECT needs a filesystem that supports it)", ExitCode.IO_ERROR) from None
    with open_output(output) as writer:
        writer.write(make_header("gpu-kinfer-bridge", trace="collected", source="direct", host=socket.gethostname(), dir=directory,
                                 devices=devices, depth=depth, size_mib=size_mib, write_fraction=write_fraction, seed=seed))
        writer.write_many(records)


def _open_loader(disks: list[int], ring: Optional[str], lanes: int = 4) -> Any:
    from gpuos_tools.kinfer import ring as R
    from gpuos_tools.kinfer.bpf.loader import Loader

    if ring is not None:  # the ring's own checks and messages (missing: is serve running?) first
        R.Ring.attach(ring).close()
    loader = Loader(disks, predict=ring is not None)
    try:
        if ring is not None:
            loader.attach_ring(R.ring_path(ring), lanes=lanes)
    except BaseException:
        loader.close()
        raise
    return loader


def _collect_ebpf(directory: Optional[str], reads: Optional[int], devices: int, depth: int, size_mib: int, write_fraction: float,
                  seed: int, disk: Optional[list[str]], seconds: Optional[float], ring: Optional[str],
                  program: Optional[list[str]], output: str, unbuffered: bool) -> None:
    import platform

    from gpuos_tools.kinfer.bpf.collect import Converter, capture

    disks = _disks(disk, directory)
    from gpuos_tools.kinfer.traces import Load

    load = Load([directory], devices=devices, depth=depth, file_size=size_mib << 20, write_fraction=write_fraction,
                seed=seed) if directory else None
    stop = _stop_on_signals()
    loader = _open_loader(disks, ring)
    try:
        if load is not None:
            try:
                load.start()  # its files are written before the tracepoints are attached
            except OSError as e:
                raise GpuosError(f"{directory}: {e.strerror or e} (O_DIRECT needs a filesystem that supports it)",
                                 ExitCode.IO_ERROR) from None
        t0 = time.monotonic_ns()
        conv = Converter(t0)
        with open_output(output, unbuffered=unbuffered or None) as writer:
            writer.write(make_header("gpu-kinfer-bridge", trace="collected", source="ebpf", kernel=platform.release(),
                                     disks=[_disk_name_of(d) for d in disks] or "all", t0_monotonic_ns=t0,
                                     object=OBJECT.name, ring=ring, dir=directory, program=program or None))
            try:
                done = capture(loader, lambda recs: writer.write_many(conv.records(recs)), seconds=seconds, reads=reads,
                               program=program, stop=stop)
            except FileNotFoundError as e:
                raise GpuosError(str(e.strerror), ExitCode.PROGRAM_NOT_FOUND) from None
            writer.write({"type": "kinfer_collect", "reason": done.reason, "seconds": round(done.seconds, 3), "reads": done.reads,
                          "records": done.records, "disks": conv.disks(), "program_status": done.returncode, **loader.stats()})
    finally:
        loader.close()
        if load is not None:
            load.close()
    stats = _capture_line(done)
    print(f"gpu-kinfer-bridge: {stats}", file=sys.stderr)


def _disk_name_of(dev: int) -> str:
    from gpuos_tools.kinfer.bpf.collect import disk_name

    return disk_name(dev)


def _capture_line(done: Any) -> str:
    return f"{done.records} I/Os ({done.reads} reads) in {done.seconds:.1f} s; {done.reason}"


@app.command(context_settings={"allow_interspersed_args": False})
def watch(
    ring: Optional[str] = typer.Option(None, "--ring", "-r", metavar="NAME", help="The daemon serving this ring decides; default: start one with --model."),
    model: Optional[str] = typer.Option(None, "--model", "-m", metavar="FILE", help="LinnOS model: served by a daemon started here, and its threshold_us tells slow reads."),
    threshold_us: Optional[float] = typer.Option(None, "--threshold-us", help="Reads slower than this are slow; default: the model's threshold_us."),
    disk: Optional[list[str]] = typer.Option(None, "--disk", metavar="DISK", help="A disk to watch (vda, /dev/vda, 254:0, or a path on it; repeat); default: every disk."),
    interval: float = typer.Option(5.0, "--interval", help="Seconds between interval reports."),
    seconds: Optional[float] = typer.Option(None, "--seconds", help="Stop after this long."),
    lanes: int = typer.Option(4, "--lanes", help="Ring lanes to claim (each lets 8 reads wait for an answer at once)."),
    trace: Optional[str] = typer.Option(None, "--trace", metavar="FILE", help="Also write every I/O as an `io` record with its decision."),
    gpu: str = typer.Option("off", "--gpu", metavar="auto|on|off", help="For the daemon watch starts itself."),
    program: Optional[list[str]] = _PROGRAM,
    output: OutputOpt = "-",
    unbuffered: UnbufferedOpt = False,
) -> None:
    """Run LinnOS live on the kernel's reads: each read's kernel-side inputs go to the daemon at
    issue; its decision is matched with the read's measured latency. Writes `kinfer_watch`
    records per disk every --interval (scope interval) and at the end (scope total): reads,
    predicted slow, actually slow, accuracy against always answering fast, added latency (issue
    to answer) and the ring round trip. A read cannot be redirected from here; see EBPF PRODUCER."""
    from gpuos_tools.kinfer import ring as R
    from gpuos_tools.kinfer.bpf.collect import Converter, WatchStats, capture

    if ring is None and model is None:
        raise typer.BadParameter("give --ring NAME (a daemon serving a LinnOS model) or --model FILE", param_hint="--ring")
    if not interval > 0 or lanes < 1:
        raise typer.BadParameter("--interval must be positive, --lanes at least 1", param_hint="--interval")
    thr = threshold_us
    if thr is None:
        if model is None:
            raise typer.BadParameter("with --ring, give --threshold-us or the --model it serves", param_hint="--threshold-us")
        thr = _load_model(model).meta.get("threshold_us")
        if thr is None:
            raise GpuosError(f"{model}: no threshold_us in the model; give --threshold-us", ExitCode.BAD_INPUT)
    disks = _disks(disk, None)
    stop = _stop_on_signals()
    proc = None
    name = ring
    if name is None:
        proc, name = _spawn_daemon(str(model), gpu)
    trace_writer = None
    try:
        loader = _open_loader(disks, name, lanes)
        try:
            conv = Converter(time.monotonic_ns())
            stats = WatchStats(float(thr))
            with open_output(output, unbuffered=unbuffered or None) as writer:
                writer.write(make_header("gpu-kinfer-bridge", ring=str(R.ring_path(name)), threshold_us=float(thr),
                                         disks=[_disk_name_of(d) for d in disks] or "all", lanes=loader.ring_info.get("lanes")))
                if trace is not None:
                    trace_writer = open_output(trace, unbuffered=unbuffered or None)
                    trace_writer.write(make_header("gpu-kinfer-bridge", trace="collected", source="ebpf", ring=name,
                                                   t0_monotonic_ns=conv.t0_ns, threshold_us=float(thr)))

                def sink(recs: Any) -> None:
                    rows = conv.records(recs)
                    stats.add(rows)
                    if trace_writer is not None:
                        trace_writer.write_many(rows)

                last = [0.0]

                def tick(elapsed: float) -> None:
                    writer.write_many(stats.reports("interval", elapsed - last[0]))
                    last[0] = elapsed

                try:
                    done = capture(loader, sink, seconds=seconds, program=program, stop=stop, tick=tick, tick_s=interval)
                except FileNotFoundError as e:
                    raise GpuosError(str(e.strerror), ExitCode.PROGRAM_NOT_FOUND) from None
                writer.write_many(stats.reports("total", done.seconds))
                writer.write({"type": "kinfer_collect", "reason": done.reason, "seconds": round(done.seconds, 3),
                              "reads": done.reads, "records": done.records, "disks": conv.disks(),
                              "program_status": done.returncode, **loader.stats()})
        finally:
            loader.close()
            if trace_writer is not None:
                trace_writer.close()
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
            R.ring_path(name).unlink(missing_ok=True)


@features_app.command("register")
def features_register(
    name: str = typer.Argument(..., metavar="NAME", help="Store name (/dev/shm/NAME)."),
    fields: list[str] = typer.Option(..., "--field", "-f", metavar="NAME", help="A field name (repeat, in order)."),
    schema: str = typer.Option("features", "--schema", help="Schema name."),
    capacity: int = typer.Option(65536, "--capacity", help="Records kept (the oldest are overwritten)."),
    mode: str = typer.Option("0600", "--mode", metavar="OCTAL", help="Permission bits of the store (0600: this user "
                             "only; 0666 lets every user record)."),
) -> None:
    """Create a feature store for vectors of the given fields (replacing a store of this user of
    that name; any other file is refused)."""
    from gpuos_tools.kinfer.features import FeatureStore
    from gpuos_tools.kinfer.policy import parse_mode

    try:
        bits = parse_mode(mode)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--mode") from None
    try:
        FeatureStore.register(name, schema, fields, capacity, mode=bits).close()
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--field") from None


@features_app.command("capture")
def features_capture(
    trace: str = typer.Argument(..., metavar="TRACE", help="An io trace."),
    name: str = typer.Argument(..., metavar="NAME", help="Store name; created with LinnOS's schema if missing."),
    capacity: int = typer.Option(1 << 20, "--capacity", help="Records kept, when the store is created here."),
) -> None:
    """Record each read of a trace into a LinnOS feature store: its 31 inputs and its latency
    (what `train --features` learns from)."""
    from gpuos_tools.kinfer import ring as R
    from gpuos_tools.kinfer.features import FeatureStore
    from gpuos_tools.kinfer.linnos import FEATURE_FIELDS, capture

    records = _read_trace(trace)
    try:
        store = FeatureStore.open(name)
    except R.RingError:
        if R.ring_path(name).exists():
            raise
        store = FeatureStore.register(name, "linnos", FEATURE_FIELDS, capacity)
    try:
        n = capture(records, store)
    except ValueError as e:
        raise GpuosError(f"{name}: {e}", ExitCode.BAD_INPUT) from None
    finally:
        store.close()
    print(f"gpu-kinfer-bridge: {n} reads recorded into {name}", file=sys.stderr)


@features_app.command("record")
def features_record(
    name: str = typer.Argument(..., metavar="NAME", help="Store name."),
    input: str = typer.Argument("-", metavar="[INPUT]", help="Records with an `x` list (one value per field)."),
) -> None:
    """Append the `x` vector of every input record, timestamped now."""
    from gpuos_tools.kinfer.features import FeatureStore

    store = FeatureStore.open(name)
    try:
        with open_input(input) as reader:
            for n, rec in enumerate(reader, 1):
                if "x" in rec and rec["type"] != "header":
                    try:
                        store.record(rec["x"])
                    except (ValueError, TypeError) as e:
                        raise GpuosError(f"{input}: record {n}: {e}", ExitCode.BAD_INPUT) from None
    finally:
        store.close()


@features_app.command("window")
def features_window(
    name: str = typer.Argument(..., metavar="NAME", help="Store name."),
    last_s: Optional[float] = typer.Option(None, "--last-s", help="Only the last this many seconds."),
    output: OutputOpt = "-",
) -> None:
    """Write the stored vectors (oldest first) as `feature` records: seq, ts_ns, x."""
    from gpuos_tools.kinfer.features import FeatureStore

    store = FeatureStore.open(name)
    try:
        since = 0 if last_s is None else max(0, time.monotonic_ns() - int(last_s * 1e9))
        ts, seq, values = store.window(since)
        fields, schema = store.fields, store.schema
    finally:
        store.close()
    with open_output(output) as writer:
        # the store's own schema name; "schema" is the stream's (gpuos/1), which readers check
        writer.write(make_header("gpu-kinfer-bridge", store=name, store_schema=schema, fields=fields))
        writer.write_many(
            {"type": "feature", "seq": int(s), "ts_ns": int(t), "x": [float(v) for v in row]}
            for t, s, row in zip(ts.tolist(), seq.tolist(), values)
        )


def main() -> None:
    run_app(app, prog="gpu-kinfer-bridge")


if __name__ == "__main__":
    main()
