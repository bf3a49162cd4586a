"""Command line: dflash-batch run | validate | status | report | export | retry | make-needle | schema."""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import click
import orjson

from dflash_batch.io.outputs import output_json_schema
from dflash_batch.job import Job, JobError, job_json_schema, load_job
from dflash_batch.plan.roofline import CARD_ACC_LEN
from dflash_batch.plan.shards import (COUNT_VAR, K8S_INDEX, SLURM_VARS, Shard, group_shard, parse_shard,
                                      resolve_shard)

if TYPE_CHECKING:
    from dflash_batch.runner import EngineFactory

SCHEMA_DIR = Path(__file__).resolve().parent.parent / "schemas"
EXIT_TOO_MANY_ERRORS = 3  # the run ended and committed its rows, but too many are error rows
EXIT_INTERRUPTED = 130  # 128 + SIGINT (Ctrl-C), as a shell reports it
EXIT_PREEMPTED = 143  # 128 + SIGTERM: Slurm's --requeue and wrappers read it as "terminated"
RESUME_HINT = "finished rows are committed; rerun the same command to resume"


def exit_now(code: int) -> NoReturn:
    """Exit without the interpreter's teardown (a second or more with torch loaded on a busy
    node, which a preempted task does not have before SIGKILL): every row is committed and
    synced already; only the standard streams need flushing."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def end_rank(code: int) -> NoReturn:
    """End a torchrun or srun rank with `code`, its exit handlers run, without the interpreter's
    teardown. After an engine run the gloo group's threads outlive destroy_process_group
    (something in C++ still holds the group: seen in /proc after it, never with a model-free
    run); the teardown then destroys them while they are joinable, and the rank dies by SIGABRT
    ("terminate called without an active exception") after a run that succeeded: about one
    two-node run in five under load, its launch failed and the other node's torchrun waiting out
    its 300 s exit barrier (tests/test_multinode.py)."""
    atexit._run_exitfuncs()
    exit_now(code)


@contextlib.contextmanager
def stops_before_any_row():
    """SIGTERM or Ctrl-C before the run takes them over (importing torch, checking the inputs:
    seconds on a busy node, where Slurm's requeue may land) stops with the same word and exit
    code as later, not with Python's silent death by SIGTERM or click's `Aborted!`. Nothing has
    been written yet, so there is nothing to commit."""
    def stop(signum: int, _frame: object) -> None:
        word = "interrupted" if signum == signal.SIGINT else "terminated"
        click.echo(f"{word} before the first row: {RESUME_HINT}", err=True)
        exit_now(EXIT_INTERRUPTED if signum == signal.SIGINT else EXIT_PREEMPTED)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _fail(e: Exception) -> None:
    click.echo(f"error: {e}", err=True)
    sys.exit(2)


def _table(header: list[str], rows: list[list]) -> str:
    cells = [header] + [["-" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)
                         for v in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _share(fraction: float | None) -> str | None:
    """The share of prompt tokens taken from shared heads (cached_tokens), once a request."""
    return None if fraction is None else f"{fraction:.0%}"


# Beside the tables that show them: the basis of their prompt tokens and cached share (io/ledger.py once_a_request)
PROMPT_BASIS = ("prompt tokens, cached: each request's prompt counted once (its sample 0), as OpenAI's usage "
                "counts it; cached: the share of them taken from a head another request computed")


@click.group()
@click.version_option(package_name="dflash-batch")
def main() -> None:
    """Offline batch generation with DFlash speculative decoding."""


def _run_shard(job: Job, shard: Shard, progress: bool, job_file: str,
               engine_factory: EngineFactory | None = None) -> None:
    """Run one shard in this process (one tensor-parallel rank); rank 0 reports. `engine_factory`:
    default, the job's engine (tests/run_fake_job.py passes its stand-in)."""
    from dflash_batch import parallel
    from dflash_batch.build import build_engine
    from dflash_batch.io.outputs import CommitError
    from dflash_batch.runner import Preempted, run_job

    shard = group_shard(shard, *parallel.data_parallel())
    try:
        result = run_job(job, engine_factory or build_engine, shard, progress=progress, job_file=job_file)
    except JobError as e:
        _fail(e)
    except CommitError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(1)
    except Preempted as e:
        interrupted = e.signum == signal.SIGINT
        click.echo(f"{'interrupted' if interrupted else 'terminated'}: {RESUME_HINT}", err=True)
        exit_now(EXIT_INTERRUPTED if interrupted else EXIT_PREEMPTED)
    except KeyboardInterrupt:  # Ctrl-C before the run took the signal (checking inputs): no row was finished
        click.echo(f"interrupted: {RESUME_HINT}", err=True)
        sys.exit(EXIT_INTERRUPTED)
    if parallel.run_rank() == 0 and result.already_complete:
        click.echo(f"shard {result.shard}: already complete for these inputs; nothing to do")
    elif parallel.run_rank() == 0:
        click.echo(f"\nshard {result.shard}: {result.rows_written} rows committed this run")
        click.echo(_table(["bucket", "rows", "ok", "error", "prompt tokens", "cached", "tokens", "acc_len",
                           "proposal_acc"],
                          [[name, s["rows"], s["ok"], s["error"], s["prompt_tokens"], _share(s["cached_share"]),
                            s["completion_tokens"], s["acc_len"], s["proposal_acceptance"]]
                           for name, s in result.stats.items()]))
        click.echo(PROMPT_BASIS)
    tally = result.progress
    if tally is None:
        return
    if tally.errors and parallel.run_rank() == 0:
        click.echo("error rows this run, by error_type:\n" + "\n".join(tally.error_summary()), err=True)
    if tally.too_many_errors(job.output.max_error_fraction):  # every rank: they ran the same rows
        if parallel.run_rank() == 0:
            click.echo(f"failed: {sum(tally.errors.values())} of the {tally.done} rows this run are error rows "
                       f"(output.max_error_fraction: {job.output.max_error_fraction}). They are committed, so "
                       "rerunning this command does not run them again: fix the cause, then run them with "
                       f"`dflash-batch retry {job.output.dir} --where error --output-dir NEW_DIR`", err=True)
        sys.exit(EXIT_TOO_MANY_ERRORS)


def cpus_given(cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """CPUs this task may use, all of its ranks together: OMP_NUM_THREADS when set, else what
    Slurm allocated (--cpus-per-task, else the job's CPUs on this node), else the CPUs this
    process may run on (an affinity mask, cgroups' cpuset), at most its CPU quota (a container's
    CPU limit: Kubernetes' resources.limits.cpu): a thread per visible core beyond the quota
    makes every small op wait for threads the quota has parked."""
    for var in ("OMP_NUM_THREADS", "SLURM_CPUS_PER_TASK", "SLURM_CPUS_ON_NODE"):
        if os.environ.get(var, "").isdigit() and int(os.environ[var]) > 0:
            return int(os.environ[var])
    try:
        visible = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        visible = os.cpu_count() or 1
    return min(visible, _cpu_quota(cgroup) or visible)


def _cpu_quota(cgroup: Path) -> int | None:
    """The CPU quota of this container's cgroup (v2 cpu.max, v1 cpu.cfs_quota_us), rounded up;
    None when it has none or the files are not there."""
    try:
        if (cgroup / "cpu.max").exists():
            quota, period = (cgroup / "cpu.max").read_text().split()[:2]
        else:
            quota = (cgroup / "cpu" / "cpu.cfs_quota_us").read_text().strip()
            period = (cgroup / "cpu" / "cpu.cfs_period_us").read_text().strip()
        if quota in ("max", "-1"):
            return None
        return max(1, -(-int(quota) // int(period)))
    except (OSError, ValueError):
        return None


def _set_threads(ranks: int) -> None:
    """Torch threads: the CPUs given, shared by the ranks of this process group, so tasks that
    share a node do not each start one per core. A process given the whole machine by nobody in
    particular keeps torch's own choice (physical cores)."""
    import torch

    given = cpus_given()
    told = any(os.environ.get(v) for v in ("OMP_NUM_THREADS", "SLURM_CPUS_PER_TASK", "SLURM_CPUS_ON_NODE"))
    if told or ranks > 1 or given < (os.cpu_count() or given):
        torch.set_num_threads(max(1, given // ranks))


def _tp_rank(rank: int, world: int, port: int, job: Job, shard: Shard, progress: bool, job_file: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    import torch

    _set_threads(world)
    if torch.cuda.is_available():  # before the group: NCCL binds to the current GPU
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", rank=rank, world_size=world)
    from dflash_batch import parallel

    parallel.form_stages(job.model.pipeline_parallel_size)
    parallel.form_data_parallel(job.model.data_parallel_size)
    code = 0
    try:  # another exception: multiprocessing reports it to the parent (a traceback) and exits 1
        _run_shard(job, shard, progress, job_file)
    except SystemExit as e:  # its code is the rank's exit status, which the parent's join returns
        code = _exit_code(e)
    finally:
        dist.destroy_process_group()
    end_rank(code)


def _layout(job: Job) -> str:
    """"N ranks (tensor_parallel_size T x pipeline_parallel_size P x data_parallel_size D)", the
    latter two only where above 1."""
    m = job.model
    more = "".join(f" x {name} {n}" for name, n in (("pipeline_parallel_size", m.pipeline_parallel_size),
                                                     ("data_parallel_size", m.data_parallel_size)) if n > 1)
    return f"{m.ranks} ranks (model.tensor_parallel_size {m.tensor_parallel_size}{more})"


def _exit_code(e: SystemExit) -> int:
    """The status a SystemExit asks for (a message: printed, status 1, as Python does)."""
    if e.code is None or isinstance(e.code, int):
        return e.code or 0
    click.echo(e.code, err=True)
    return 1


@main.command()
@click.argument("job_file", type=click.Path(dir_okay=False))
@click.option("--shard", "shard_text", help="INDEX/COUNT. Without it, in this order (plan/shards.py): the "
              f"job's sharding section (mode explicit or none); Slurm's array variables ({', '.join(SLURM_VARS)}); "
              f"a Kubernetes indexed Job's {K8S_INDEX} (its count from sharding.count, else {COUNT_VAR}); "
              "else 0/1.")
@click.option("--output-dir", help="Override output.dir.")
@click.option("--no-progress", is_flag=True, help="No progress bars.")
@click.option("--eager", is_flag=True, help="Run the decode round eagerly: no CUDA graphs, no torch.compile "
              "(sets engine.cuda_graphs and engine.compile to false).")
@click.option("--dry-run", is_flag=True, help="Print this shard's first rows as the engine would get them "
              "(rendered prompt, tokens, bucket, or the row's error) and run nothing.")
def run(job_file: str, shard_text: str | None, output_dir: str | None, no_progress: bool, eager: bool,
        dry_run: bool) -> None:
    """Run JOB_FILE (this process's shard of it); resumes where a previous run stopped.

    With model.tensor_parallel_size N > 1 it starts N local rank processes itself, unless it is
    already one of N ranks started by torchrun or srun."""
    with stops_before_any_row():
        _run(job_file, shard_text, output_dir, no_progress, eager, dry_run)


def _run(job_file: str, shard_text: str | None, output_dir: str | None, no_progress: bool, eager: bool,
         dry_run: bool) -> None:
    from dflash_batch import parallel

    try:
        job = load_job(job_file)
        if output_dir:
            job = job.model_copy(update={"output": job.output.model_copy(update={"dir": output_dir})})
        if eager:
            engine = job.engine.model_copy(update={"cuda_graphs": False, "compile": False})
            job = job.model_copy(update={"engine": engine})
        shard = resolve_shard(job.sharding, os.environ, parse_shard(shard_text) if shard_text else None)
        if job.engine.gpu_memory is not None:  # before any model is loaded
            from dflash_batch.sizing import fit_job

            job = fit_job(job, Path(job_file).parent)  # engine.context_parallel decided where absent
        if dry_run:
            _dry_run(job, shard)
            return
    except JobError as e:
        _fail(e)
    ranks = job.model.ranks
    if parallel.init_from_env():
        if parallel.world_size() != ranks:
            _fail(JobError(f"started with {parallel.world_size()} ranks but the job runs {_layout(job)}"))
        parallel.form_stages(job.model.pipeline_parallel_size)
        parallel.form_data_parallel(job.model.data_parallel_size)
        _set_threads(1)  # one rank a process: srun's --cpus-per-task, or OMP_NUM_THREADS per rank
        try:
            _run_shard(job, shard, not no_progress, job_file)
        except Exception as e:  # this rank failed, or a collective found a rank gone: say which, stop the group
            click.echo(f"error: {parallel.describe_rank()}: {type(e).__name__}: {e}", err=True)
            if parallel.lost_rank(e):
                click.echo("the run lost a rank: the first one to fail names itself in its "
                           f"log (a rank killed outright names nobody: see its node's log). {RESUME_HINT}", err=True)
            end_rank(1)  # the group not left: shutting it down could wait on the rank that is gone
        except SystemExit as e:  # a run that stops itself (too many error rows, a bad job): its group is whole
            parallel.leave_group()
            end_rank(_exit_code(e))
        parallel.leave_group()
        end_rank(0)
    elif ranks == 1:
        _set_threads(1)
        _run_shard(job, shard, not no_progress, job_file)
    else:
        import socket

        import torch.multiprocessing as mp

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ranks = mp.start_processes(_tp_rank, args=(ranks, port, job, shard, not no_progress, job_file), nprocs=ranks,
                                   join=False, start_method="spawn")
        # Slurm signals this process only (and `kill -INT` too): pass SIGTERM and SIGINT on so every
        # rank commits and stops at the same row, and exits 128 + it, which the join below returns.
        for stop in (signal.SIGTERM, signal.SIGINT):
            signal.signal(stop, lambda signum, _: [os.kill(p.pid, signum) for p in ranks.processes if p.is_alive()])
        try:
            while not ranks.join():
                pass
        except mp.ProcessExitedException as e:
            sys.exit(e.exit_code)
        except mp.ProcessRaisedException as e:
            click.echo(f"error in a tensor-parallel rank:\n{e}", err=True)
            sys.exit(1)


def _dry_run(job: Job, shard: Shard, rows: int = 5) -> None:
    """The first `rows` prepared rows of this shard (no checkpoint loaded, nothing written)."""
    from dflash_batch.plan.ahead import prepared_batches
    from dflash_batch.plan.buckets import plan_buckets
    from dflash_batch.runner import check_job, open_tokenizer

    check_job(job)
    tokenizer, _ = open_tokenizer(job)
    buckets = plan_buckets(job)
    job = job.model_copy(update={"output": job.output.model_copy(update={"include_prompt": True})})  # keep the text
    shown = 0
    for batch in prepared_batches(job, tokenizer, shard, set(), None):
        for row in batch:
            if row.error_type:
                click.echo(f"--- row {row.row_id}: error {row.error_type}: {row.error}")
            else:
                text = row.prompt_text if row.prompt_text is not None else f"(token ids) {row.prompt_ids[:32]}"
                click.echo(f"--- row {row.row_id}: {len(row.prompt_ids)} prompt tokens"
                           f"{' (truncated)' if row.prompt_truncated else ''} + max_new_tokens "
                           f"{row.sampling.max_new_tokens} x n {row.sampling.n} -> bucket {buckets[row.bucket].name}")
                click.echo(text if len(text) <= 2000 else f"{text[:2000]}... ({len(text)} characters)")
            shown += 1
            if shown == rows:
                return
    click.echo(f"--- {shown} row(s) in shard {shard.index}/{shard.count}")


@main.command()
@click.argument("job_file", type=click.Path(dir_okay=False))
@click.option("--no-inputs", is_flag=True, help="Check the job file only: not its input files, checkpoints "
              "or what this host can run.")
def validate(job_file: str, no_inputs: bool) -> None:
    """Check JOB_FILE, its inputs and its engine settings on this host, without running anything."""
    from dflash_batch.build import resolve_engine
    from dflash_batch.io.inputs import duplicate_ids
    from dflash_batch.io.outputs import check_writable
    from dflash_batch.runner import check_job, open_tokenizer
    from dflash_batch.sizing import fit_job

    try:
        job = load_job(job_file)
        if no_inputs:
            check_writable(Path(job.output.dir))
        else:
            check_job(job)
            found = duplicate_ids(job.input)
            if found["count"]:
                shown = "; ".join(f"{e['row_id']!r} at {', '.join(e['where_list'][:4])}" for e in found["examples"])
                raise JobError(f"input: {found['count']} id(s) are held by more than one row ({found['rows']} rows), "
                               f"e.g. {shown} (file#index, 0-based). Rows with one id would be written under one "
                               "key, and a resume would skip the later ones: make the ids unique, or drop "
                               "input.id_column to key rows by file and index")
            open_tokenizer(job)
        # config.json alone (or the shipped one): even with --no-inputs
        job = fit_job(job, Path(job_file).parent)
        if not no_inputs:
            click.echo(resolve_engine(job).describe())
    except JobError as e:
        _fail(e)
    click.echo(f"{job_file}: ok")


@main.command("plan")
@click.argument("job_file", type=click.Path(dir_okay=False, exists=True))
@click.option("--gpu-memory", help="The GPU: h100, h200, b200, gb300 or its memory in GB (default: the "
              "job's engine.gpu_memory); a named one gets the roofline too.")
@click.option("--gpus-per-node", type=int, help="GPUs an NVLink domain joins (default: the named GPU's: 8 on "
              "HGX, 72 on GB300 NVL72; else 8).")
@click.option("--tensor-parallel", type=int, help="Plan at this many ranks (default: the job's).")
@click.option("--reserve-gb", type=float, help="Memory no tensor shows (default: 6% of the GPU, at least 8 GB); "
              "the job's engine.gpu_memory_headroom is kept free beside it.")
@click.option("--acc-len", type=float, default=CARD_ACC_LEN, show_default=True,
              help="Acceptance length at every draft verified, for the roofline (the model card's MATH-500 "
              "figure): alpha_j = p^j.")
@click.option("--acceptance", "acceptance_dir", type=click.Path(file_okay=False, exists=True),
              help="A finished run's output directory: the roofline's per-draft acceptance from its rounds "
              "(dflash-batch report's alpha) instead of --acc-len.")
@click.option("--roofline/--no-roofline", default=True, show_default=True,
              help="With a named GPU, each bucket's floors a round by drafts verified, and the layouts.")
@click.option("--routing", "routing_dir", type=click.Path(file_okay=False, exists=True),
              help="A finished run's output directory: the expert-parallel layout's hottest rank over the mean "
              "from its routing counts, placed as `dflash-batch experts place` would (the mean over layers), "
              "instead of the assumed 1.11 (TRT-LLM's DeepSeek-R1 at EP32 after EPLB).")
def plan_command(job_file: str, gpu_memory: str | None, gpus_per_node: int | None, tensor_parallel: int | None,
                 reserve_gb: float | None, acc_len: float, acceptance_dir: str | None, roofline: bool,
                 routing_dir: str | None) -> None:
    """Memory per rank of JOB_FILE on a GPU, from its checkpoints' config.json alone (models built
    on the meta device): weights, each bucket's caches and activations in the layout the job runs
    (the MLA latents split where run and validate split them), its max_num_seqs beside the largest
    that fits with the reserve and engine.gpu_memory_headroom kept free, the smallest
    tensor-parallel size that fits. On a named GPU, the roofline: a round's floors (memory,
    compute, network), the one that binds and the tokens/s per GPU for each number of drafts
    verified, and the layouts side by side. The plan is for a CUDA GPU with the gpu extra
    installed, whatever this host has. Exits 1 when the job does not fit."""
    from dflash_batch.job import gpu_bytes
    from dflash_batch.plan.hardware import HARDWARE, hardware
    from dflash_batch.sizing import gb, plan_job, smallest_tp

    try:
        for option, value, least in (("--gpus-per-node", gpus_per_node, 1), ("--tensor-parallel", tensor_parallel, 1),
                                     ("--reserve-gb", reserve_gb, 0), ("--acc-len", acc_len, 1)):
            if value is not None and not least <= value < float("inf"):
                raise JobError(f"{option} {value}: give a number of {least} or more")
        job = load_job(job_file)
        memory = gpu_memory or job.engine.gpu_memory
        if memory is None:
            raise JobError("give --gpu-memory (or set engine.gpu_memory in the job)")
        try:
            gpu = gpu_bytes(memory)
            hw = hardware(memory) if roofline and str(memory).strip().lower() in HARDWARE else None
        except ValueError as e:
            raise JobError(f"--gpu-memory: {e}") from None
        if hw is not None:
            try:
                hw.peak(job.model.dtype)
            except ValueError as e:
                raise JobError(f"roofline: {e}; --no-roofline plans memory alone") from None
        if routing_dir is not None and hw is None:
            raise JobError(f"--routing is for the roofline: name the GPU ({', '.join(HARDWARE)}) with "
                           "--gpu-memory or engine.gpu_memory, and leave --no-roofline out")
        if acceptance_dir is not None and hw is None:
            raise JobError(f"--acceptance is for the roofline: name the GPU ({', '.join(HARDWARE)}) with "
                           "--gpu-memory or engine.gpu_memory, and leave --no-roofline out")
        per_domain = gpus_per_node or (hw.nvlink_gpus if hw else 8)
        tp = tensor_parallel or job.model.tensor_parallel_size
        if hw is not None and tp > per_domain and tp % per_domain:
            raise JobError(f"TP{tp} does not fill NVLink domains of {per_domain} GPUs evenly (--gpus-per-node)")
        reserve = None if reserve_gb is None else int(reserve_gb * 10**9)
        job_dir = Path(job_file).parent
        plan = plan_job(job, job_dir, gpu, tensor_parallel, reserve, with_split=True)
        alpha = _acceptance(acceptance_dir, acc_len, max(n.block for n in plan.runs.needs) - 1) if hw else None
        click.echo(plan.table())
        nodes = -(-plan.tp // per_domain)
        click.echo(f"TP{plan.tp}: {nodes} NVLink domain(s) of {per_domain} GPUs a tensor-parallel group")
        least = smallest_tp(job, job_dir, gpu, reserve)
        click.echo(f"smallest tensor_parallel_size that fits one sequence a bucket: {least or 'none up to 64'}")
        stages = job.model.pipeline_parallel_size
        if hw is not None and plan.fits and stages > 1:  # the tables size a TP group, stages beside it
            click.echo(f"roofline: the layouts of these {tp * stages} GPUs side by side, pipeline stages among them, "
                       f"are in the plan of this job with tensor_parallel_size {tp * stages} and "
                       "pipeline_parallel_size 1 (its 'layouts at k' lines)")
        elif hw is not None and plan.fits:
            from dflash_batch.throughput import ASSUMED_IMBALANCE
            from dflash_batch.throughput import roofline as roofline_tables

            imbalance = ASSUMED_IMBALANCE if routing_dir is None else _measured_imbalance(routing_dir, plan.tp * stages
                                                                                        * job.model.data_parallel_size)
            click.echo(roofline_tables(plan, job, job_dir, hw, alpha, per_domain, imbalance))
            source = "assumed; --routing RUN_DIR measures it" if routing_dir is None else f"from {routing_dir}"
            click.echo(f"expert-parallel layouts: the hottest rank's routed tokens {imbalance:.2f}x the mean ({source})")
        elif hw is not None:
            click.echo("roofline: none, the job does not fit")
        elif roofline:
            click.echo(f"roofline: name the GPU ({', '.join(HARDWARE)}) for its figures")
    except JobError as e:
        _fail(e)
    layout = f" {plan.layout()}" if plan.layout() else ""
    if not plan.fits:
        click.echo(f"{job_file}: does not fit at TP{plan.tp}{layout} on a GPU of {gb(gpu)} GB (see 'NO' above)",
                   err=True)
        sys.exit(1)
    click.echo(f"{job_file}: fits{layout}")


def _measured_imbalance(run_dir: str, ranks: int) -> float:
    """The hottest expert rank over the mean, averaged over layers, for a run's routing counts placed
    over `ranks` ranks as `experts place` places them."""
    from dflash_batch.plan.experts import placement_of_run

    _, rows = placement_of_run(Path(run_dir), ranks, 0)
    return sum(r[3] for r in rows) / len(rows)


def _acceptance(out_dir: str | None, acc_len: float, drafts: int) -> list[float]:
    """alpha_1..alpha_drafts for the roofline: a finished run's (report's per-draft alpha over its
    rounds), or from an acceptance length."""
    from dflash_batch.io.ledger import array_spec
    from dflash_batch.plan.roofline import card_acceptance

    if drafts == 0:  # no bucket speculates: nothing to accept
        return []
    if out_dir is None:
        try:
            return card_acceptance(acc_len, drafts)
        except ValueError as e:
            raise JobError(f"--acc-len: {e}") from None
    from dflash_batch.report import build_report

    try:
        alpha = build_report(Path(out_dir))["overall"]["alpha"]
    except (FileNotFoundError, KeyError) as e:  # the message names the directory
        raise JobError(f"--acceptance: {e}") from None
    missing = [j for j, a in enumerate(alpha[:drafts], 1) if a is None] + list(range(len(alpha) + 1, drafts + 1))
    if missing:
        raise JobError(f"--acceptance {out_dir}: no acceptance recorded for draft(s) {array_spec(missing)} "
                       f"of {drafts} (its rounds never verified them, or its parts predate per-draft stats)")
    return alpha[:drafts]


@main.command()
@click.argument("out_dir", type=click.Path(file_okay=False, exists=True))
def status(out_dir: str) -> None:
    """Rows done / error per shard (beside the rows it holds once complete, counted from the
    inputs) and per bucket, from the committed files of OUT_DIR; which shards are running (their
    progress files), which are incomplete, and the command that finishes them."""
    from dflash_batch.io.ledger import RAY_INPUT, array_spec, count_committed, duplicate_keys, lock_path
    from dflash_batch.io.progress import describe_live, live_state, lock_held, read_progress, resume_lines
    from dflash_batch.plan.expected import settled_states

    out = Path(out_dir)
    run_file = out / "run.json"
    if not run_file.exists():
        _fail(JobError(f"{out}: no run.json; not a dflash-batch output directory"))
    run_record = orjson.loads(run_file.read_bytes())
    num_shards = run_record["num_shards"]
    by_shard, by_bucket, by_error = count_committed(out)
    done = [by_shard[(i, "ok")] + by_shard[(i, "error")] for i in range(num_shards)]
    states, expected, unknown = settled_states(out, run_record, done)
    if unknown:
        click.echo(f"(expected rows unknown: {unknown})", err=True)
    from_ray = run_record["job"]["input"]["paths"] == [RAY_INPUT]
    records, now = [read_progress(out, i) for i in range(num_shards)], time.time()
    live = [live_state(r, lock_held(lock_path(out, i)), now) for i, r in enumerate(records)]
    # A shard some run worked on (it left a record) is not "not started", even before its first part.
    states = [lv or ("incomplete" if r and s == "not started" else s) for lv, r, s in zip(live, records, states)]
    click.echo(_table(["shard", "expected", "ok", "error", "state"],
                      [[i, expected[i], by_shard[(i, "ok")], by_shard[(i, "error")], states[i]]
                       for i in range(num_shards)]))
    names = sorted({k for k, _ in by_bucket}, key=lambda x: (x is None, x))
    click.echo("\n" + _table(["bucket", "ok", "error", "prompt tokens", "cached"],
                             [[n, by_bucket[(n, "ok")], by_bucket[(n, "error")], by_bucket[(n, "prompt_tokens")],
                               _share(by_bucket[(n, "cached_tokens")] / by_bucket[(n, "prompt_tokens")]
                                      if by_bucket[(n, "prompt_tokens")] else None)] for n in names]))
    click.echo(PROMPT_BASIS)
    ok = sum(c for (_, status), c in by_shard.items() if status == "ok")
    click.echo(f"\ntotal: {ok} ok, {sum(by_shard.values()) - ok} error, {num_shards} shard(s), "
               f"{states.count('complete')} complete")
    if by_error:
        click.echo("error rows: " + ", ".join(f"{n} {kind} (e.g. row {example!r})"
                                              for kind, (n, example) in sorted(by_error.items(), key=str)))
    for i in (i for i, lv in enumerate(live) if lv):
        click.echo(describe_live(i, live[i], records[i], done[i], expected[i], now))
    for i, found in duplicate_keys(out, num_shards).items():
        shown = ", ".join(f"({r['row_id']!r}, {r['sample_index']})" for r in found["examples"])
        click.echo(f"duplicate ids: shard {i} committed {found['rows']} rows under {found['count']} (row_id, "
                   f"sample_index) keys, e.g. {shown}: input rows share an id (dflash-batch validate lists them)")
    todo = [i for i, s in enumerate(states) if s not in ("complete", "running", "stalled", "ray")]
    if from_ray:
        if "ray" in states:
            click.echo("rows from a Ray Data pipeline, not marked finished: run it again to finish (committed rows "
                       "are read back, not generated again), then call dflash_batch.ray.finish(OUT_DIR)")
    elif todo:
        # Data-parallel groups each commit a shard of their own: task i's groups hold shards i * D ..
        groups = run_record.get("job", {}).get("model", {}).get("data_parallel_size", 1)
        tasks = sorted({i // groups for i in todo})
        lines = resume_lines(tasks, num_shards // groups, run_record.get("job_file") or "JOB_FILE", out, records)
        click.echo(f"incomplete: shard(s) {array_spec(todo)}; to finish them:\n" + "\n".join(f"  {x}" for x in lines))


@main.command()
@click.argument("out_dir", type=click.Path(file_okay=False, exists=True))
@click.option("--group-by", help="Column to group by (default: dataset, when present).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable JSON instead of Markdown.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False),
              help="Where to write the PNG (default: OUT_DIR/report.png).")
@click.option("--answer-column", help="A column with each prompt's expected answer: score the responses.")
@click.option("--match", type=click.Choice(["exact", "contains", "last-number"]), default="last-number",
              show_default=True, help="How a response must give the answer.")
def report(out_dir: str, group_by: str | None, as_json: bool, plot_path: str | None, answer_column: str | None,
           match: str) -> None:
    """Acceptance tables of OUT_DIR (all shards): per group, per bucket, per position; with an
    answer column, how many responses are right."""
    from dflash_batch.report import build_report, plot, to_markdown

    try:
        result = build_report(Path(out_dir), group_by, answer_column, match)
    except (FileNotFoundError, KeyError) as e:
        _fail(JobError(str(e).strip('"')))
    png = Path(plot_path) if plot_path else Path(out_dir) / "report.png"
    if result["overall"]["rounds"]:
        plot(result, png)
    if as_json:
        click.echo(orjson.dumps(result, option=orjson.OPT_INDENT_2).decode())
    else:
        click.echo(to_markdown(result))
        if result["overall"]["rounds"]:
            click.echo(f"\nplot: {png}")


@main.command()
@click.argument("out_dir", type=click.Path(file_okay=False, exists=True))
@click.argument("dest", type=click.Path())
@click.option("--format", "fmt", type=click.Choice(["hf", "openai_batch"]), default="hf", show_default=True,
              help="hf: DEST a dataset directory (data/train-*.parquet + card); openai_batch: DEST a JSONL file "
              "of OpenAI Batch API output lines, one per request.")
@click.option("--rows-per-file", type=click.IntRange(min=1), default=100_000, show_default=True)
@click.option("--messages", "messages_column", help="hf: add an SFT `messages` column: this passthrough "
              "column's chat messages (or text, as one user turn), then the assistant's response (and reasoning); "
              "`conversation` in a run of conversations: every turn, tool calls and results included.")
@click.option("--partial", is_flag=True, help="Export a run that has not finished: the rows committed so far "
              "(the card says so). Without it, such a run is refused.")
def export(out_dir: str, dest: str, fmt: str, rows_per_file: int, messages_column: str | None, partial: bool) -> None:
    """Write OUT_DIR's rows (merged with the runs it retries, its rows winning) to DEST."""
    from dflash_batch.io.export import export_dataset, export_openai_batch

    try:
        if fmt == "openai_batch":
            if messages_column:
                raise JobError("--messages applies to --format hf only")
            count = export_openai_batch(Path(out_dir), Path(dest), partial)
            click.echo(f"{dest}: {count} request lines")
        else:
            count = export_dataset(Path(out_dir), Path(dest), rows_per_file, messages_column, partial)
            click.echo(f"{dest}: {count} rows")
    except JobError as e:
        _fail(e)


@main.command()
@click.argument("out_dir", type=click.Path(file_okay=False, exists=True))
@click.option("--where", multiple=True, required=True, help="Rows to run again: error, length (finish_reason), "
              "error_type=NAME; several: any of them.")
@click.option("--set", "sets", multiple=True, help="FIELD=VALUE (a YAML value) changed from OUT_DIR's job, "
              "e.g. sampling.max_new_tokens=4096; a sampling field set here also replaces rows' own values "
              "(sampling_columns, request bodies).")
@click.option("--output-dir", required=True, type=click.Path(file_okay=False), help="The retry's own directory.")
def retry(out_dir: str, where: tuple[str, ...], sets: tuple[str, ...], output_dir: str) -> None:
    """Make a new run of the chosen samples of the finished run OUT_DIR: writes OUTPUT_DIR/job.yaml
    (run it like any job); `export OUTPUT_DIR` then merges it over OUT_DIR."""
    from dflash_batch.retry import JOB_FILE, make_retry

    try:
        samples, rows = make_retry(Path(out_dir), list(where), list(sets), Path(output_dir))
    except JobError as e:
        _fail(e)
    if not samples:
        click.echo(f"nothing to retry: no row of {out_dir} matches --where {' '.join(where)}")
        return
    job_file = Path(output_dir) / JOB_FILE
    click.echo(f"{samples} sample(s) of {rows} row(s) chosen; run them with:\n  dflash-batch run {job_file}\n"
               f"then `dflash-batch export {output_dir} DEST` writes {out_dir}'s rows with these in their place")


@main.group()
def experts() -> None:
    """Routed experts under model.expert_parallel."""


@experts.command("place")
@click.argument("run_dir", type=click.Path(file_okay=False, exists=True))
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False),
              help="The placement file to write (model.expert_placement).")
@click.option("--ranks", type=int, help="Ranks the experts go on: data_parallel_size x tensor_parallel_size "
              "(default: the run's).")
@click.option("--redundant", type=int, help="Replica slots a rank, for the hottest experts (model.redundant_experts; "
              "default: the run's).")
def place(run_dir: str, output: str, ranks: int | None, redundant: int | None) -> None:
    """Balance the experts over the ranks from RUN_DIR's routing counts (every shard's stats): the
    hottest rank's load over the mean per layer, by default and placed, and the placement file."""
    import orjson

    from dflash_batch.io.outputs import atomic_write_bytes
    from dflash_batch.plan.experts import placement_of_run

    model = orjson.loads((Path(run_dir) / "run.json").read_bytes())["job"]["model"]
    ranks = ranks or model.get("data_parallel_size", 1) * model["tensor_parallel_size"]
    redundant = model.get("redundant_experts", 0) if redundant is None else redundant
    try:
        placement, rows = placement_of_run(Path(run_dir), ranks, redundant)
    except JobError as e:
        _fail(e)
    atomic_write_bytes(Path(output), orjson.dumps(placement.to_json(), option=orjson.OPT_INDENT_2))
    click.echo(_table(["layer", "routed tokens", "hottest/mean default", "hottest/mean placed"], rows))
    click.echo(f"\nwrote {output}: {placement.experts} experts on {ranks} ranks, {placement.slots} slots each "
               f"({redundant} replica slot(s)); run with model.expert_placement: {output}")


@main.command("make-needle")
@click.argument("texts", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--tokenizer", "tokenizer_dir", required=True, type=click.Path(exists=True, file_okay=False),
              help="The target's checkpoint (or tokenizer) directory: lengths count its tokens.")
@click.option("--lengths", default="8192,32768,65536,131072", show_default=True,
              help="Prompt lengths in tokens, comma-separated.")
@click.option("--count", type=click.IntRange(min=1), default=20, show_default=True, help="Prompts per length.")
@click.option("--keys", type=click.IntRange(min=1), default=4, show_default=True, help="Needles per prompt.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--out", "out_file", required=True, type=click.Path(dir_okay=False), help="JSONL file to write.")
def make_needle(texts: tuple[str, ...], tokenizer_dir: str, lengths: str, count: int, keys: int, seed: int,
                out_file: str) -> None:
    """Write RULER-style multi-key needle prompts (JSONL: id, messages, needle_answer,
    needle_length, needle_depths) at each length, TEXTS as the haystack. Run them with
    messages_column: messages and passthrough_columns: [needle_answer, needle_length]; `report`
    then puts retrieval beside acceptance."""
    from dflash_batch.needle import make_needles
    from dflash_batch.tokenizer import Tokenizer

    try:
        sizes = [int(x) for x in lengths.split(",")]
        rows = make_needles([Path(t).read_text(errors="replace") for t in texts], Tokenizer(tokenizer_dir),
                            sizes, count, keys, seed)
        written = 0
        Path(out_file).parent.mkdir(parents=True, exist_ok=True)
        with open(out_file, "wb") as f:
            for row in rows:
                f.write(orjson.dumps(row) + b"\n")
                written += 1
    except ValueError as e:
        _fail(JobError(f"make-needle: {e}"))
    click.echo(f"{out_file}: {written} prompts")


@main.command()
@click.option("--check", is_flag=True, help="Fail if the checked-in schemas differ.")
@click.option("--dir", "schema_dir", default=str(SCHEMA_DIR), show_default=True)
def schema(check: bool, schema_dir: str) -> None:
    """Write schemas/job.schema.json and schemas/output.schema.json from the code."""
    d = Path(schema_dir)
    docs = {"job.schema.json": job_json_schema(), "output.schema.json": output_json_schema()}
    stale = []
    for name, doc in docs.items():
        text = orjson.dumps(doc, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS).decode() + "\n"
        path = d / name
        if check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path))
        else:
            d.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            click.echo(f"wrote {path}")
    if stale:
        _fail(JobError(f"out of date: {', '.join(stale)}; run `dflash-batch schema`"))


if __name__ == "__main__":
    main()
