"""`moe-serve`: the service (default), and the offline commands `forward` and `write-checkpoint`.

    moe-serve [serve flags]                      start the HTTP + gRPC service (service.server)
    moe-serve forward --input IN --output OUT    one batch through the rank group, offline
                      [--weights PATH --layer N --top-k K ...]   the service's weight and layer flags
    moe-serve write-checkpoint OUT               a synthetic checkpoint in Hugging Face naming
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import typing

import pydantic

from service.config import PRESETS, Settings, default_text, preset
from service.errors import ConfigError, MoEError

log = logging.getLogger("moe-serve")

OFFLINE_COMMANDS = ("forward", "write-checkpoint")


# Settings that `moe-serve forward` shares with the service: the layer, its weights, the group.
FORWARD_SETTINGS = ("weights", "weights_prefix", "layer", "top_k", "preset", "device", "world_size", "capacity",
                    "dtype", "seed", "backend", "start_timeout_s", "step_timeout_s")


def add_settings_flags(p: argparse.ArgumentParser, names=None) -> None:
    """One flag per Settings field (--http-port for http_port, ...), all of them or `names`; a flag
    left out keeps the MOE_* variable or the default.

    Values are checked by Settings alone, flags and variables alike (a Literal's choices are only
    shown): argparse's `choices` would refuse what a Settings validator normalises, such as
    `--log-level debug`. A boolean's flag is also a switch: `--shm-direct` alone means true,
    `--shm-direct false` (or any value pydantic reads as a bool) still gives the value."""
    for name, field in Settings.model_fields.items():
        if names is not None and name not in names:
            continue
        metavar = None
        kinds = (field.annotation, *typing.get_args(field.annotation))
        for arg in kinds:
            if typing.get_origin(arg) is typing.Literal:
                metavar = "{" + ",".join(map(str, typing.get_args(arg))) + "}"
        switch: dict[str, str] = {}
        if bool in kinds:  # bool or bool | None
            switch, metavar = {"nargs": "?", "const": "true"}, "{true,false}"
        help_text = (field.description or name.replace("_", " ")) + f" (default: {default_text(name)})"
        help_text = help_text.replace("%", "%%")  # argparse %-formats help: a description's "5 %" is text
        p.add_argument("--" + name.replace("_", "-"), dest=name, default=argparse.SUPPRESS,
                       metavar=metavar, help=help_text, **switch)


def settings_from(parser: argparse.ArgumentParser, flags: dict) -> Settings:
    """Settings from flags over MOE_* variables; a bad value exits 2 naming where it came from: its
    flag (with the usage), or its variable (without: the command line was not at fault)."""
    try:
        return Settings(**flags)
    except pydantic.ValidationError as err:
        problems, from_flags = [], False
        for e in err.errors():
            field = "_".join(str(x) for x in e["loc"])
            if not field:
                problems.append(e["msg"])
            elif field in flags:
                from_flags = True
                problems.append(f"--{field.replace('_', '-')}: {e['msg']}")
            else:
                problems.append(f"{Settings.model_config['env_prefix']}{field.upper()}={e['input']!r} "
                                f"(environment): {e['msg']}")
        if from_flags:
            parser.error("; ".join(problems))
        parser.exit(2, f"{parser.prog}: error: {'; '.join(problems)}\n")


def build_parser() -> argparse.ArgumentParser:
    """The service's flags: one per Settings field."""
    p = argparse.ArgumentParser(prog="moe-serve", description="Serve the MoE layer over HTTP and gRPC. "
                                "Every flag can also be set as MOE_<NAME> in the environment.",
                                epilog="Offline commands: `moe-serve forward` (one batch from a safetensors "
                                "file through the rank group) and `moe-serve write-checkpoint` (a synthetic "
                                "checkpoint); see `moe-serve forward --help`.")
    add_settings_flags(p)
    return p


def parse_settings(argv: list[str] | None) -> Settings:
    parser = build_parser()
    return settings_from(parser, vars(parser.parse_args(argv)))


def _offline_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moe-serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    f = sub.add_parser("forward", help="run one batch (a safetensors file) through the rank group",
                       description="Run one batch through the rank group. The weight and layer flags are the "
                       "service's (and read the same MOE_* variables).")
    f.add_argument("--input", required=True,
                   help="safetensors with hidden_states [T,H], topk_ids [T,K], topk_weights [T,K]")
    f.add_argument("--output", required=True, help="safetensors to write: output [T,H] in the dtype of hidden_states")
    add_settings_flags(f, FORWARD_SETTINGS)
    f.set_defaults(parser=f)

    w = sub.add_parser("write-checkpoint", help="write a synthetic checkpoint in HF per-expert naming",
                       description="Write a synthetic checkpoint (the weights the service makes from a seed) as "
                       "one safetensors file with Hugging Face per-expert keys, which `moe-serve --weights FILE` "
                       "(and `forward`) can load.")
    w.add_argument("output", help="the safetensors file to write")
    w.add_argument("--preset", choices=sorted(PRESETS), default="cpu", help="layer shape (default: %(default)s)")
    w.add_argument("--seed", type=int, default=0, help="seed of the synthetic weights (default: %(default)s)")
    w.add_argument("--prefix", default="", help="key prefix, e.g. model.layers.0.mlp. (default: none)")
    w.add_argument("--naming", choices=("hf", "mixtral"), default="hf",
                   help="keys PREFIXexperts.E.NAME.weight with NAME gate_proj/up_proj/down_proj (hf) "
                        "or w1/w3/w2 (mixtral) (default: %(default)s)")
    return p


def _check_writable(path: str, what: str) -> None:
    """Refuse an output path that cannot be written before any work is done on it."""
    target = os.path.abspath(path)
    folder = os.path.dirname(target)
    if os.path.isdir(target):
        raise ConfigError(f"{what} {path} is a directory; name a file")
    if not os.path.isdir(folder):
        raise ConfigError(f"{what} {path}: the folder {folder} does not exist")
    if not os.access(target if os.path.exists(target) else folder, os.W_OK):
        raise ConfigError(f"{what} {path} is not writable (permission denied)")


def _readable_by_all(path: str) -> None:
    """Give a written file the mode open() would (0644 under the usual umask 022): safetensors
    creates it 0600, which the container's user (UID 10001) cannot read when it is mounted."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def _forward(args: argparse.Namespace) -> None:
    from safetensors import SafetensorError
    from safetensors.torch import load_file, save_file

    from service.api.codecs import ModelSpec, rows_error, validate
    from service.errors import InvalidInput
    from service.moe.weights import checkpoint_layer
    from service.worker.group import WorkerGroup

    _check_writable(args.output, "--output")
    settings = settings_from(args.parser, {k: v for k, v in vars(args).items() if k in FORWARD_SETTINGS})
    device, why = settings.resolve_device()
    try:
        tensors = load_file(args.input)
    except (OSError, SafetensorError) as err:
        raise InvalidInput(f"cannot read --input {args.input}: {err}") from None
    missing = [k for k in ("hidden_states", "topk_ids", "topk_weights") if k not in tensors]
    if missing:
        raise InvalidInput(f"--input {args.input} lacks {missing}; it has {sorted(tensors)}")
    x, ids, w = tensors["hidden_states"], tensors["topk_ids"], tensors["topk_weights"]
    if x.dim() != 2 or ids.dim() != 2:
        raise InvalidInput(f"hidden_states must be [T, H] and topk_ids [T, K], got {list(x.shape)}, {list(ids.shape)}")

    cfg = settings.layer_config(device)
    prefix = settings.weights_prefix
    if settings.weights:
        cfg, spec = checkpoint_layer(cfg, settings.weights, prefix=prefix, layer=settings.layer,
                                     top_k=settings.top_k, default_k=ids.shape[1])
        prefix = spec.prefix
    else:  # synthetic weights take the batch's shape
        if settings.top_k is not None and settings.top_k != ids.shape[1]:
            raise InvalidInput(f"--top-k {settings.top_k} but topk_ids is {list(ids.shape)}")
        cfg = cfg.replace(H=x.shape[1], K=ids.shape[1])
    if (x.shape[1], ids.shape[1]) != (cfg.H, cfg.K):
        raise InvalidInput(f"hidden_states {list(x.shape)} and topk_ids {list(ids.shape)} do not fit the layer "
                           f"(H={cfg.H}, K={cfg.K})")
    # The service's checks and messages (dtypes, shapes, ids in [0, E), finite values): one batch of
    # any T (it runs in steps), its hidden_states checked as the slot would hold them.
    x, ids, w = validate(x, ids, w, ModelSpec.of(cfg, max_tokens=max(1, x.shape[0])))
    bad = rows_error(x.to(cfg.dtype), x)
    if bad is not None:
        raise bad[1]
    log.info("device %s (%s); layer %s; %d tokens", device, why, cfg.describe(), x.shape[0])

    started = time.monotonic()

    def progress(done: int, total: int) -> None:
        if total > cfg.tokens_per_step:
            log.info("%d/%d tokens (%.0f%%), %.1f s", done, total, 100 * done / total, time.monotonic() - started)

    with WorkerGroup(cfg, device=device, weights=settings.weights, weights_prefix=prefix,
                     seed=settings.seed, backend=settings.backend, start_timeout_s=settings.start_timeout_s,
                     step_timeout_s=settings.step_timeout_s) as group:
        out = group.forward(x, ids, w, progress=progress)
    save_file({"output": out.contiguous()}, args.output, metadata={"format": "pt"})
    _readable_by_all(args.output)
    log.info("wrote output [%d, %d] %s to %s in %.1f s", out.shape[0], out.shape[1],
             str(out.dtype).removeprefix("torch."), args.output, time.monotonic() - started)


def _write_checkpoint(args: argparse.Namespace) -> None:
    from service.moe.weights import write_synthetic_checkpoint

    _check_writable(args.output, "the output")
    cfg = preset(args.preset)
    write_synthetic_checkpoint(args.output, cfg, args.seed, prefix=args.prefix, naming=args.naming)
    _readable_by_all(args.output)
    log.info("wrote a synthetic checkpoint (%s, seed %d, %s naming) to %s",
             cfg.describe(), args.seed, args.naming, args.output)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in OFFLINE_COMMANDS:
        settings = parse_settings(argv)
        from service.server import serve

        return serve(settings)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = _offline_parser().parse_args(argv)
    try:
        {"forward": _forward, "write-checkpoint": _write_checkpoint}[args.command](args)
    except MoEError as err:
        log.error("%s", err)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
