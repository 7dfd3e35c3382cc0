"""``python -m estimatorch.checkpoint``: show what a checkpoint holds, or upgrade older ones in place.

Exit status 0 when the command did its work, 2 on an error (the message goes to stderr).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
from typing import Any, Optional

import torch

from ._files import atomic_save
from ._format import FORMAT_VERSION, CheckpointError, migrate, validate
from ._ledger import ledger_summary, ledger_table, merge_ledgers
from ._locate import Located, locate
from ._lock import DirectoryLock, DirectoryLockedError
from ._progress import alive, progress_path, read_progress
from ._sharded import read_rank_state, sharded_tensors
from ._sharded_run import read_sharded_payload
from ._weights import is_weights

__all__ = ["main"]

DESCRIPTION = "Show what an estimatorch checkpoint holds, or upgrade older checkpoints in place."
INSPECT_HELP = ("Show what a checkpoint, weights export, {prefix}-latest pointer or directory "
                "(its newest valid file) holds.")
MIGRATE_HELP = "Upgrade the older-format checkpoints in a directory in place (each original kept as FILE.v<N>)."


def _migrate_dir(directory: str) -> int:
    upgraded = refused = 0
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if not name.endswith(".pt") or not os.path.isfile(path):
            continue
        try:
            raw = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:  # noqa: BLE001 - not a loadable file: report and go on
            print(f"skip {name}: unreadable ({err})")
            continue
        if is_weights(raw):
            print(f"ok   {name}: a weights export (nothing to upgrade)")
            continue
        version = raw.get("format_version") if isinstance(raw, dict) else None
        if version == FORMAT_VERSION:
            print(f"ok   {name}: already format {FORMAT_VERSION}")
            continue
        try:
            payload = migrate(raw, source=name)
            validate(payload, source=name)
        except CheckpointError as err:
            print(f"FAIL {name}: {err}")
            refused += 1
            continue
        backup = f"{path}.v{version}"
        if not os.path.exists(backup):
            shutil.copy2(path, backup)
        atomic_save(payload, path)
        print(f"up   {name}: format {version} -> {FORMAT_VERSION} (original kept as {os.path.basename(backup)})")
        upgraded += 1
    print(f"{upgraded} upgraded, {refused} refused")
    return 2 if refused else 0


def _size(state: Any) -> str:
    tensors = [v for v in state.values() if isinstance(v, torch.Tensor)]
    dtypes = sorted({str(t.dtype).replace("torch.", "") for t in tensors})
    return f"{len(tensors)} tensors, {sum(t.numel() for t in tensors)} values ({', '.join(dtypes) or 'no dtype'})"


def storage_options(pairs: list[str]) -> Optional[dict[str, Any]]:
    """``--storage-option KEY=VALUE`` pairs over the JSON object of ``$ESTIMATORCH_STORAGE_OPTIONS``:
    fsspec's arguments for a URL. A VALUE that reads as JSON is taken as such
    (``client_kwargs={"endpoint_url": "http://127.0.0.1:8333"}``), else as a string."""
    options: dict[str, Any] = {}
    env = os.environ.get("ESTIMATORCH_STORAGE_OPTIONS")
    if env:
        try:
            options = json.loads(env)
        except ValueError as err:
            raise CheckpointError(f"$ESTIMATORCH_STORAGE_OPTIONS is not a JSON object: {err}") from None
        if not isinstance(options, dict):
            raise CheckpointError(f"$ESTIMATORCH_STORAGE_OPTIONS must be a JSON object, got {env[:60]!r}")
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise CheckpointError(f"--storage-option takes KEY=VALUE, got {pair!r}")
        try:
            options[key] = json.loads(value)
        except ValueError:
            options[key] = value
    return options or None


def run_ledger(payload: dict[str, Any], path: str) -> Optional[dict[str, Any]]:
    """The run's ledger as known from the checkpoint ``payload`` (read from ``path``) and the progress
    mark beside it (``_progress.py``): the totals of :func:`._ledger.ledger_summary`; None for a file
    of an earlier version. An attempt the mark shows still running is ``"running"`` while its
    process lives on this host, else ``"killed"``; without a mark, what the checkpoint says."""
    saved = payload["ranks"][0].get("ledger") if payload.get("ranks") else None
    if saved is None:
        return None
    progress = read_progress(progress_path(os.path.dirname(path.rstrip("/"))))
    same = progress is not None and progress["ledger"]["run_id"] == saved["run_id"]
    over = same and not alive(progress)  # type: ignore[arg-type]
    ledger = merge_ledgers(saved, progress["ledger"] if same else None, over=over)  # type: ignore[index]
    return ledger_summary(ledger) if ledger is not None else None


def _description(found: Located, payload: Optional[dict[str, Any]]) -> dict[str, Any]:
    """What ``inspect --json`` prints: the file, its kind, and for a checkpoint the position, plan,
    world size, state fingerprint and the run's ledger."""
    out: dict[str, Any] = {"path": found.path, "kind": found.kind}
    if payload is None:
        return {**out, "ledger": None}
    first = payload["ranks"][0]
    return {**out, "format_version": payload.get("format_version"), "world_size": payload.get("world_size"),
            "position": first.get("position"), "plan": first.get("plan"),
            "state_fingerprint": _state_fingerprint(first.get("state_fingerprint")),
            "ledger": run_ledger(payload, found.path)}


def _state_fingerprint(value: Any) -> Optional[str]:
    """A saved state fingerprint in hex (None when none was saved); an object's header holds
    tensors without their values."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor) and value.is_meta:
        return "(a tensor in the file: not read from the header)"
    return f"{int(value) & (2**64 - 1):#018x}"


def _inspect(path: str, options: Optional[dict[str, Any]] = None, as_json: bool = False) -> int:
    found: Located = locate(path, options, header=True)  # an object's tensors are not downloaded
    for reason in found.skipped:
        print(f"warning: skipped {reason}", file=sys.stderr)
    if as_json:
        payload = None
        if found.kind == "checkpoint":
            payload = found.content
        elif found.kind == "sharded":
            try:
                payload = read_sharded_payload(found.path)
            except CheckpointError:
                if "snapshot" in (read_rank_state(found.path, 0) or {}):
                    raise  # a fit's, damaged: what a resume refuses
        print(json.dumps(_description(found, payload), indent=2))
        return 0
    if found.how:
        print(f"{found.path} ({found.how})")
    if found.kind == "sharded":
        marker = found.content
        print(f"{found.path}: sharded checkpoint (a directory), estimatorch {marker.get('estimatorch_version')}, "
              f"torch {marker.get('torch_version')}, world size {marker['world_size']}")
        tensors = sharded_tensors(found.path)
        dtypes = ", ".join(sorted({str(dtype).replace("torch.", "") for _, dtype in tensors.values()}))
        print(f"model {len(tensors)} tensors, {sum(math.prod(shape) for shape, _ in tensors.values())} values "
              f"({dtypes or 'no dtype'}), in shards of {marker['world_size']} ranks")
        try:
            payload = read_sharded_payload(found.path)
        except CheckpointError:
            rank_state = read_rank_state(found.path, 0)
            if isinstance(rank_state, dict) and "snapshot" in rank_state:
                raise  # a fit's, damaged: what a resume refuses
            return 0  # the storage layer alone wrote it: no run state
        _print_run(payload, found.path)
        print(f"optimizer {payload.get('optimizer_class', 'of unknown class')}")
        return 0
    if found.kind == "weights":
        keys = list(found.content)
        print(f"{found.path}: weights export (a state dict for load_state_dict), {_size(found.content)}")
        print(f"keys {keys[:8]}{' ...' if len(keys) > 8 else ''}")
        return 0
    payload = found.content
    print(f"{found.path}: checkpoint, format {payload['format_version']}, "
          f"estimatorch {payload['estimatorch_version']}, torch {payload['torch_version']}, "
          f"world size {payload['world_size']}")
    _print_run(payload, found.path)
    print(f"model {_size(payload['model'])}; optimizer {payload.get('optimizer_class', 'of unknown class')}")
    return 0


def _print_run(payload: dict[str, Any], path: str) -> None:
    """The run's part of rank 0's snapshot, as saved (the store checks only its envelope), and
    the run's ledger."""
    first, missing = payload["ranks"][0], "(missing)"
    print(f"position {first.get('position', missing)}, plan {first.get('plan', missing)}")
    print(f"fingerprint {first.get('fingerprint', missing)}")
    print(f"handlers {sorted(first['handlers'])}")
    _print_metrics(first)
    state = _state_fingerprint(first.get("state_fingerprint"))
    if state is not None:
        print(f"state fingerprint {state} (parameters and optimizer state, checked on resume)")
    ledger = run_ledger(payload, path)
    for line in ledger_table(ledger) if ledger is not None else ["ledger: none (written before the run ledger)"]:
        print(line)


def _print_metrics(snapshot: dict[str, Any]) -> None:
    """The metrics of the last epoch the snapshot's history recorded, and each handler's best
    monitored value (``CheckpointHandler``'s ``best``, ``EarlyStoppingHandler``'s with its epoch)."""
    history = snapshot.get("history")
    if isinstance(history, dict) and history.get("epochs"):
        values = {name: series[-1] for name, series in history.get("values", {}).items() if series}
        shown = ", ".join(f"{name} {_number(value)}" for name, value in values.items())
        print(f"metrics of epoch {history['epochs'][-1]}: {shown or '(none recorded)'}")
    else:
        print("metrics: none recorded yet (no epoch finished)")
    bests = []
    for name, state in sorted(snapshot.get("handlers", {}).items()):
        best = state.get("best") if isinstance(state, dict) else None
        if isinstance(best, (int, float)) and not isinstance(best, bool) and math.isfinite(best):
            epoch = state.get("best_epoch")
            bests.append(f"{name} {_number(best)}" + (f" (epoch {epoch})" if isinstance(epoch, int) and epoch else ""))
    if bests:
        print(f"best monitored value: {'; '.join(bests)}")


def _number(value: Any) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m estimatorch.checkpoint", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p_inspect = sub.add_parser("inspect", help=INSPECT_HELP, description=INSPECT_HELP)
    p_inspect.add_argument("path", help="A checkpoint or export file, a {prefix}-latest pointer, or a directory; "
                           "or an fsspec URL of one (s3://bucket/run/model-latest).")
    p_inspect.add_argument("--json", action="store_true",
                           help="Print one JSON object instead: path, kind, position, plan, state fingerprint and the "
                           "run's ledger (attempts, steps_lost, seconds_lost, goodput); see docs/checkpoints.md.")
    p_inspect.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE",
                           help="For a URL: an fsspec argument of its filesystem (repeat it; a VALUE in JSON is "
                           "parsed: client_kwargs='{\"endpoint_url\": \"http://host:8333\"}'). Also read from "
                           "$ESTIMATORCH_STORAGE_OPTIONS (a JSON object); else the environment's credentials.")
    p_migrate = sub.add_parser("migrate", help=MIGRATE_HELP, description=MIGRATE_HELP)
    p_migrate.add_argument("directory",
                           help="The directory whose checkpoints to upgrade (no fit may be writing there).")
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    """The command line: ``inspect PATH`` or ``migrate DIRECTORY``.

    Returns:
        The exit status: 0 when the command did its work, 2 on an error (the message goes to
        stderr). A malformed command line exits with status 2 through ``argparse``.
    """
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "migrate":
            if not os.path.isdir(args.directory):
                what = "is not a directory" if os.path.exists(args.directory) else "does not exist"
                parser.error(f"directory {args.directory!r} {what}")
            lock = DirectoryLock(args.directory)  # never while a fit writes there
            lock.acquire()
            try:
                return _migrate_dir(args.directory)
            finally:
                lock.release()
        return _inspect(args.path, storage_options(args.storage_option), as_json=args.json)
    except FileNotFoundError as err:
        print(f"error: {err.filename!r} does not exist" if err.filename else f"error: {err}", file=sys.stderr)
        return 2
    except (CheckpointError, DirectoryLockedError, OSError, ValueError, ImportError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
