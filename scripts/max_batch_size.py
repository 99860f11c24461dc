#!/usr/bin/env python
"""Each method's largest batch (or width, depth, resolution, sequence length) within a memory budget.

The same search as ``zoomem max-batch`` (the logic is :mod:`zoomem.maxbatch`); every probe is a real training
step. Examples:

    python scripts/max_batch_size.py timm/resnet50 --image-size 96 --budget 512MiB --threads 1 \\
        --out benchmarks/maxbatch_resnet50.json
    python scripts/max_batch_size.py pyg/gcn --budget 256MiB --methods pytorch lossless L2 --resume \\
        --out /tmp/gcn.json                       # a killed run picks up where it stopped
    python scripts/max_batch_size.py hf/bert-base-uncased --dim depth --batch 8 --budget 2GiB
    python scripts/max_batch_size.py --render benchmarks/maxbatch_*.json --markdown   # tables again, no run
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Sequence

from zoomem import maxbatch


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--render"]:  # print the tables of result JSONs again (and, for several, the goals); run nothing
        render = argparse.ArgumentParser(prog="max_batch_size.py --render")
        render.add_argument("json", nargs="+")
        render.add_argument("--markdown", action="store_true")
        args = render.parse_args(argv[1:])
        datas = [json.loads(Path(p).read_text()) for p in args.json]
        print("\n\n".join(maxbatch.format_results(d, args.markdown) for d in datas))
        if len(datas) > 1:
            print("\n" + maxbatch.format_goal_summary(datas, args.markdown))
        return 0
    parser = argparse.ArgumentParser(prog="max_batch_size.py", description=__doc__.split("\n\n")[0],
                                     epilog="--render JSON [JSON ...] [--markdown] prints saved results' tables again")
    maxbatch.add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s", stream=sys.stderr)
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    return maxbatch.main(args, maxbatch.command_line("python scripts/max_batch_size.py", argv))


if __name__ == "__main__":
    sys.exit(main())
