"""`moe-serve`: the service (default), and the offline commands `forward` and `write-checkpoint`.

    moe-serve [serve flags]                      start the HTTP + gRPC service (service.server)
    moe-serve forward --input IN --output OUT    one batch through the rank group, offline
    moe-serve write-checkpoint OUT               a synthetic checkpoint in Hugging Face naming
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from service.config import PRESETS, Settings, preset
from service.errors import MoEError

log = logging.getLogger("moe-serve")

OFFLINE_COMMANDS = ("forward", "write-checkpoint")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moe-serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    f = sub.add_parser("forward", help="run one batch (a safetensors file) through the rank group")
    f.add_argument("--input", required=True, help="safetensors with hidden_states [T,H], topk_ids [T,K], topk_weights [T,K]")
    f.add_argument("--output", required=True, help="safetensors to write: output [T,H] in the dtype of hidden_states")
    f.add_argument("--weights", help="safetensors checkpoint (HF or Mixtral per-expert naming); synthetic if omitted")
    f.add_argument("--weights-prefix", default="", help="key prefix, e.g. model.layers.0.mlp.")
    f.add_argument("--preset", choices=sorted(PRESETS), help="layer preset (default: seed on GPU, cpu otherwise)")
    f.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    f.add_argument("--world-size", type=int, help="ranks R (default: the preset's)")
    f.add_argument("--capacity", type=int, help="tokens per rank and step C (default: the preset's)")
    f.add_argument("--seed", type=int, default=0, help="seed of the synthetic weights")
    f.add_argument("--backend", choices=("auto", "serial", "fused"), default="auto",
                   help="layer backend; auto: fused where it can run (GPU), else serial")

    w = sub.add_parser("write-checkpoint", help="write a synthetic checkpoint in HF per-expert naming")
    w.add_argument("output")
    w.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--prefix", default="", help="key prefix, e.g. model.layers.0.mlp.")
    w.add_argument("--naming", choices=("hf", "mixtral"), default="hf")
    return p


def _forward(args: argparse.Namespace) -> None:
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import load_file, save_file

    from service.errors import InvalidInput
    from service.moe.weights import inspect_checkpoint
    from service.worker.group import WorkerGroup

    settings = Settings(device=args.device, preset=args.preset, world_size=args.world_size,
                        capacity=args.capacity)
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
    if not x.is_floating_point() or ids.is_floating_point() or not w.is_floating_point():
        raise InvalidInput(f"dtypes: hidden_states float, topk_ids integer, topk_weights float; "
                           f"got {x.dtype}, {ids.dtype}, {w.dtype}")

    cfg = settings.layer_config(device)
    shape = {"H": x.shape[1], "K": ids.shape[1]}
    if args.weights:
        E, H, I = inspect_checkpoint(args.weights, args.weights_prefix)
        shape.update(E=E, I=I)
        if H != x.shape[1]:
            raise InvalidInput(f"hidden_states has H={x.shape[1]} but the checkpoint has H={H}")
    cfg = cfg.replace(**shape)
    log.info("device %s (%s); layer %s; %d tokens", device, why, cfg.describe(), x.shape[0])

    started = time.monotonic()

    def progress(done: int, total: int) -> None:
        if total > cfg.tokens_per_step:
            log.info("%d/%d tokens (%.0f%%), %.1f s", done, total, 100 * done / total, time.monotonic() - started)

    with WorkerGroup(cfg, device=device, weights=args.weights, weights_prefix=args.weights_prefix,
                     seed=args.seed, backend=args.backend, start_timeout_s=settings.start_timeout_s,
                     step_timeout_s=settings.step_timeout_s) as group:
        out = group.forward(x, ids.to(torch.int32), w.float(), progress=progress)
    save_file({"output": out.contiguous()}, args.output, metadata={"format": "pt"})
    log.info("wrote output [%d, %d] %s to %s in %.1f s", out.shape[0], out.shape[1],
             str(out.dtype).removeprefix("torch."), args.output, time.monotonic() - started)


def _write_checkpoint(args: argparse.Namespace) -> None:
    from service.moe.weights import write_synthetic_checkpoint

    cfg = preset(args.preset)
    write_synthetic_checkpoint(args.output, cfg, args.seed, prefix=args.prefix, naming=args.naming)
    log.info("wrote a synthetic checkpoint (%s, seed %d, %s naming) to %s",
             cfg.describe(), args.seed, args.naming, args.output)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in OFFLINE_COMMANDS:
        from service.server import main as serve

        return serve(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = _parser().parse_args(argv)
    try:
        {"forward": _forward, "write-checkpoint": _write_checkpoint}[args.command](args)
    except MoEError as err:
        log.error("%s", err)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
