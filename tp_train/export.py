"""Command line: `python -m tp_train.export CHECKPOINT OUT_DIR [--config DIR]` writes the model of a tensor-parallel
checkpoint as a Hugging Face `save_pretrained` directory (see `tp_train.export_hf`)."""

from __future__ import annotations

import argparse
import pickle
import sys

from tp_train.export_hf import export_hugging_face


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tp_train.export", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a checkpoint directory (e.g. outputs/<run>/checkpoints/last.ckpt)")
    parser.add_argument("out_dir", help="the save_pretrained directory to write")
    parser.add_argument("--config", help="a directory with the model's config.json (default: from the checkpoint)")
    args = parser.parse_args(argv)
    try:
        out = export_hugging_face(args.checkpoint, args.out_dir, config=args.config)
    except (ValueError, OSError, pickle.UnpicklingError, EOFError) as error:  # a user error: one line, status 2
        print(f"error: {str(error).splitlines()[0] if str(error) else type(error).__name__}", file=sys.stderr)
        sys.exit(2)
    print(f"exported to {out}")


if __name__ == "__main__":
    main()
