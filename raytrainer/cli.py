"""The ``raytrainer`` command: submit training scripts to a Ray cluster as Ray jobs, and manage them.

    raytrainer submit [--address URL] [--working-dir DIR] [--pip PKG ...] [--env K=V ...] [--no-wait]
                      [--insecure] -- python train.py ARGS
    raytrainer jobs list | status ID | logs ID [--follow] | stop ID      [--address URL] [--insecure]
    raytrainer plot OUTPUT_DIR [--out DIR] [--direction minimize|maximize]

The address is the cluster's dashboard (Jobs API): ``--address``, else ``RAY_API_SERVER_ADDRESS`` /
``RAY_ADDRESS`` (``http://`` is added to a bare ``host:port``), else ``http://127.0.0.1:8265``.

Token authentication (``RAY_AUTH_MODE=token`` on the cluster): the token is read from ``RAY_AUTH_TOKEN``,
the file ``RAY_AUTH_TOKEN_PATH`` or ``~/.ray/auth_token``, and sent as a bearer header. Without a token
the command refuses to talk to a dashboard that is not on a loopback address, unless ``--insecure``.

``submit`` streams the job's logs and exits with the job's status: 0 when it succeeded, the driver's exit
code (or 1) when it failed, 3 when it was stopped; ``--no-wait`` prints the job id and returns.

``plot`` needs no cluster: it writes PNGs of a run's curves (or of a hyperparameter search's trials) from
the files in OUTPUT_DIR to ``--out`` (default OUTPUT_DIR/plots) and prints their paths (raytrainer/plot.py).
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import os
import re
import socket
import sys
import time
from urllib.parse import urlparse

DEFAULT_ADDRESS = "http://127.0.0.1:8265"
# Runtime-env variables are stored with the job and shown in the dashboard: no secrets there.
_SECRET_NAME = re.compile(r"(TOKEN|SECRET|PASSWORD|PASSWD|API_KEY|ACCESS_KEY|PRIVATE_KEY)", re.IGNORECASE)
EXIT_STOPPED = 3


class CliError(Exception):
    """A usage or connection problem: printed without a traceback, exit status 2."""


# -- connection ------------------------------------------------------------------------------------
def resolve_address(address: str | None) -> str:
    address = address or os.environ.get("RAY_API_SERVER_ADDRESS") or os.environ.get("RAY_ADDRESS")
    if not address or address == "auto":
        return DEFAULT_ADDRESS
    if address.startswith("ray://"):
        raise CliError(f"--address {address!r} is a Ray Client address; the Jobs API is the dashboard's "
                       "HTTP address, e.g. http://head-node:8265.")
    return address if "://" in address else f"http://{address}"


def auth_token() -> str | None:
    """The Ray auth token, where Ray itself looks for it (the first one found)."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return os.environ["RAY_AUTH_TOKEN"].strip()
    for path in (os.environ.get("RAY_AUTH_TOKEN_PATH"), os.path.expanduser("~/.ray/auth_token")):
        if path and os.path.isfile(path):
            with open(path) as f:
                return f.read().strip() or None
    return None


def is_loopback(address: str) -> bool:
    host = urlparse(address).hostname or ""
    if host == "localhost":
        return True
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


def connect(address: str | None, insecure: bool = False):
    """A ``JobSubmissionClient`` for the dashboard at ``address``, with the token when there is one."""
    from ray.job_submission import JobSubmissionClient

    url = resolve_address(address)
    token = auth_token()
    if token is None and not insecure and not is_loopback(url):
        raise CliError(
            f"{url} is not a loopback address and no Ray auth token was found (RAY_AUTH_TOKEN, "
            "RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token): anyone who can reach that dashboard could run "
            "code on the cluster. Set the cluster's token (RAY_AUTH_MODE=token), or pass --insecure."
        )
    headers = {"Authorization": f"Bearer {token}"} if token else None
    try:
        return JobSubmissionClient(url, headers=headers)
    except Exception as exc:
        raise CliError(f"cannot reach the Ray Jobs API at {url}: {_first_line(exc)}") from None


def _first_line(exc: Exception) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0] if "Unauthorized" not in text and "Forbidden" not in text else text


# -- submit ----------------------------------------------------------------------------------------
def parse_env(items: list[str]) -> dict[str, str]:
    env = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise CliError(f"--env {item!r} must be KEY=VALUE")
        if _SECRET_NAME.search(key):
            raise CliError(
                f"--env {key}=... looks like a secret: a job's runtime env is stored with the job and shown "
                "in the Ray dashboard. Give it to the cluster's nodes instead (their environment, or a "
                "Kubernetes secret: see cluster/kuberay-rayjob.yaml); raytrainer reads HF_TOKEN from there."
            )
        env[key] = value
    return env


def runtime_env(args) -> dict:
    env = {}
    if args.working_dir:
        if "://" not in args.working_dir and not os.path.isdir(args.working_dir):
            raise CliError(f"--working-dir {args.working_dir!r} is not a folder")
        env["working_dir"] = args.working_dir
    if args.pip:
        env["pip"] = list(args.pip)
    variables = parse_env(args.env or [])
    if variables:
        env["env_vars"] = variables
    return env


def _entrypoint(command: list[str]) -> str:
    import shlex

    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise CliError("nothing to run: give the command after --, e.g. raytrainer submit -- python train.py")
    return shlex.join(command)


def cmd_submit(args) -> int:
    entrypoint = _entrypoint(args.command)
    env = runtime_env(args)
    client = connect(args.address, args.insecure)
    job_id = client.submit_job(entrypoint=entrypoint, runtime_env=env or None,
                               submission_id=args.submission_id)
    print(f"raytrainer: submitted job {job_id} to {resolve_address(args.address)}", file=sys.stderr,
          flush=True)
    if args.no_wait:
        print(job_id)
        return 0
    return follow(client, job_id)


def follow(client, job_id: str) -> int:
    """Stream the job's logs until it ends; return the exit status for its final state."""
    async def tail():
        async for chunk in client.tail_job_logs(job_id):
            sys.stdout.write(chunk)
            sys.stdout.flush()

    try:
        asyncio.run(tail())
    except KeyboardInterrupt:
        print(f"\nraytrainer: stopped following; the job goes on. `raytrainer jobs stop {job_id}` stops it.",
              file=sys.stderr)
        return 130
    return exit_status(client, job_id)


def exit_status(client, job_id: str, timeout: float = 30.0) -> int:
    from ray.job_submission import JobStatus

    deadline = time.monotonic() + timeout
    info = client.get_job_info(job_id)
    while not info.status.is_terminal() and time.monotonic() < deadline:  # logs end just before the status
        time.sleep(0.2)
        info = client.get_job_info(job_id)
    detail = f": {info.message}" if info.status != JobStatus.SUCCEEDED and info.message else ""
    print(f"raytrainer: job {job_id} {info.status.value}{detail}", file=sys.stderr)
    if info.status == JobStatus.SUCCEEDED:
        return 0
    if info.status == JobStatus.STOPPED:
        return EXIT_STOPPED
    return getattr(info, "driver_exit_code", None) or 1


# -- jobs ------------------------------------------------------------------------------------------
def cmd_jobs(args) -> int:
    client = connect(args.address, args.insecure)
    if args.action == "list":
        jobs = sorted(client.list_jobs(), key=lambda j: j.start_time or 0)
        print(f"{'SUBMISSION ID':<28} {'STATUS':<10} {'STARTED':<19} ENTRYPOINT")
        for job in jobs:
            started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime((job.start_time or 0) / 1000))
            print(f"{job.submission_id or job.job_id or '-':<28} {job.status.value:<10} {started:<19} "
                  f"{job.entrypoint}")
        return 0
    if not args.job_id:
        raise CliError(f"raytrainer jobs {args.action} needs a job id (see raytrainer jobs list)")
    if args.action == "status":
        info = client.get_job_info(args.job_id)
        print(info.status.value + (f": {info.message}" if info.message else ""))
        return 0
    if args.action == "logs":
        if args.follow:
            return follow(client, args.job_id)
        sys.stdout.write(client.get_job_logs(args.job_id))
        return 0
    stopped = client.stop_job(args.job_id)
    print(f"stopping {args.job_id}" if stopped else f"{args.job_id} had already ended")
    return 0


# -- plot ----------------------------------------------------------------------------------------------
def cmd_plot(args) -> int:
    from raytrainer.plot import PlotError, plot

    try:
        paths = plot(args.output_dir, args.out, args.direction)
    except PlotError as err:
        raise CliError(str(err)) from None
    for path in paths:
        print(path)
    return 0


def cmd_consolidate(args) -> int:
    from raytrainer.consolidate import consolidate

    try:
        written = consolidate(args.checkpoint, args.out, args.max_shard_size)
    except (ValueError, FileNotFoundError) as err:
        raise CliError(str(err)) from None
    out = args.out or args.checkpoint
    for name in written:
        print(f"{out.rstrip('/')}/{name}")
    return 0


# -- parser ----------------------------------------------------------------------------------------
def _connection_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", help=f"the Ray dashboard (Jobs API) URL; default $RAY_ADDRESS or "
                                          f"{DEFAULT_ADDRESS}")
    parser.add_argument("--insecure", action="store_true",
                        help="allow talking to a non-loopback dashboard without a Ray auth token")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="raytrainer", description="Run raytrainer scripts on Ray clusters.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    submit = sub.add_parser("submit",
                            help="submit a script as a Ray job, stream its logs, exit with its status")
    _connection_flags(submit)
    submit.add_argument("--working-dir",
                        help="folder (or remote URI) uploaded as the job's working directory")
    submit.add_argument("--pip", nargs="+", action="extend", metavar="PKG", help="pip packages for the job")
    submit.add_argument("--env", action="append", metavar="K=V", help="environment variable for the job")
    submit.add_argument("--submission-id", help="the job's id (default: generated)")
    submit.add_argument("--no-wait", action="store_true", help="print the job id and return")
    submit.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command, e.g. python train.py")
    jobs = sub.add_parser("jobs", help="list jobs, show a job's status or logs, stop a job")
    _connection_flags(jobs)
    jobs.add_argument("action", choices=["list", "status", "logs", "stop"])
    jobs.add_argument("job_id", nargs="?")
    jobs.add_argument("--follow", action="store_true", help="logs: follow until the job ends")
    plot = sub.add_parser("plot", help="write PNGs of a run's training and evaluation curves, or of a "
                                       "hyperparameter search's trials")
    plot.add_argument("output_dir", metavar="OUTPUT_DIR", help="a run's or a search's output_dir")
    plot.add_argument("--out", metavar="DIR", help="where the PNGs go (default: OUTPUT_DIR/plots)")
    plot.add_argument("--direction", choices=["minimize", "maximize"], default="minimize",
                      help="a search's objective direction, for the best-so-far curve (default: minimize)")
    consolidate = sub.add_parser(
        "consolidate", help="write a sharded checkpoint's model (FSDP's DCP shards, DeepSpeed ZeRO "
                            "partitions) as safetensors that from_pretrained loads, tensor by tensor")
    consolidate.add_argument("checkpoint", metavar="CHECKPOINT",
                             help="a checkpoint-<step> folder or .raytrainer/final-model (a path or a URI)")
    consolidate.add_argument("out", metavar="OUT", nargs="?",
                             help="where the files go (default: CHECKPOINT itself, when it is local)")
    consolidate.add_argument("--max-shard-size", default="5GB",
                             help="largest output file, as save_pretrained's max_shard_size (default: 5GB)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return {"submit": cmd_submit, "jobs": cmd_jobs, "plot": cmd_plot,
                "consolidate": cmd_consolidate}[args.cmd](args)
    except CliError as err:
        print(f"raytrainer: error: {err}", file=sys.stderr)
        return 2
    except Exception as exc:  # the Jobs API's errors (401/403, unknown job, ...) without a traceback
        if type(exc).__module__.startswith(("ray", "requests", "aiohttp")):
            print(f"raytrainer: error: {_first_line(exc)}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
