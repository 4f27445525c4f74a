"""Write ``examples/sample_visual_sizes.jsonl``: a synthetic mix of a VLM dataset's visuals.

The file feeds the ViT-balance simulator (``python -m lightning_vit_balance.simulate``). It is
synthetic, drawn with a fixed seed, and only sizes matter (no pixels). 400 samples, one JSON
object per line, with the raw sizes a data pipeline knows before any processor runs::

    {"id": "photo-0001", "kind": "photo", "images": [{"width": 308, "height": 231}]}
    {"id": "video-0001", "kind": "video", "videos": [{"width": 837, "height": 470, "frames": 32}]}

The mix (``kind``):

* ``photo`` (45%): one camera or web photo, from thumbnails (224 px) to 12 MP phone shots;
* ``document`` (20%): one scanned page (A4 or Letter, 150 to 300 dpi), receipt, screenshot or long
  web capture;
* ``multi`` (15%): two to six images (product sets, comic pages, before/after pairs, slides);
* ``video`` (12.5%): one clip of 4 to 32 sampled frames at 360p to 720p, sometimes with a still;
* ``text`` (7.5%): no visual at all (text-only samples leave ranks without images).

Sides are jittered by up to 10% so that not every photo has the same size. Run this script to
regenerate the file (``--output FILE`` writes elsewhere); ``tests/test_simulate.py`` checks that
the committed file is its output.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Sequence
from pathlib import Path

__all__ = ["KIND_COUNTS", "OUTPUT", "build_samples", "main", "render"]

OUTPUT = Path(__file__).resolve().parent / "sample_visual_sizes.jsonl"
#: Samples of each kind (400 in all).
KIND_COUNTS: dict[str, int] = {"photo": 180, "document": 80, "multi": 60, "video": 50, "text": 30}

_PHOTOS = [(4032, 3024), (3024, 4032), (1920, 1080), (1280, 960), (1024, 768), (800, 600), (640, 480)]
_PHOTOS += [(320, 240), (224, 224)]
_PHOTO_WEIGHTS = [10, 6, 14, 10, 12, 14, 14, 12, 8]
_DOCUMENTS = [(2480, 3508), (1240, 1754), (1700, 2200), (2550, 3300), (576, 2000), (1920, 1080), (2560, 1440)]
_DOCUMENTS += [(1280, 6000)]
_SETS = [(800, 800), (600, 900), (1280, 720), (1024, 768), (480, 480), (1920, 1080)]
_VIDEOS = [(640, 360), (854, 480), (854, 480), (1280, 720)]


def _jitter(rng: random.Random, size: tuple[int, int]) -> dict[str, int]:
    scale = rng.uniform(0.9, 1.0)
    return {"width": max(1, round(size[0] * scale)), "height": max(1, round(size[1] * scale))}


def _sample(rng: random.Random, kind: str) -> dict[str, object]:
    if kind == "photo":
        return {"images": [_jitter(rng, rng.choices(_PHOTOS, _PHOTO_WEIGHTS)[0])]}
    if kind == "document":
        return {"images": [_jitter(rng, rng.choice(_DOCUMENTS))]}
    if kind == "multi":
        size = rng.choice(_SETS)
        return {"images": [_jitter(rng, size) for _ in range(rng.randint(2, 6))]}
    if kind == "video":
        clip = {**_jitter(rng, rng.choice(_VIDEOS)), "frames": rng.choice([4, 8, 8, 16, 16, 24, 32])}
        sample: dict[str, object] = {"videos": [clip]}
        if rng.random() < 0.2:
            sample["images"] = [_jitter(rng, rng.choice(_PHOTOS))]
        return sample
    return {"images": []}


def build_samples(seed: int = 0) -> list[dict[str, object]]:
    """The samples, shuffled, each with an ``id`` and its ``kind``."""
    rng = random.Random(seed)
    kinds = [kind for kind, count in KIND_COUNTS.items() for _ in range(count)]
    rng.shuffle(kinds)
    numbers = dict.fromkeys(KIND_COUNTS, 0)
    samples = []
    for kind in kinds:
        numbers[kind] += 1
        samples.append({"id": f"{kind}-{numbers[kind]:04d}", "kind": kind, **_sample(rng, kind)})
    return samples


def render(seed: int = 0) -> str:
    """The file's text: one compact JSON object per line."""
    return "".join(json.dumps(sample, separators=(", ", ": ")) + "\n" for sample in build_samples(seed))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--output",
        type=Path,
        default=OUTPUT,
        help=f"the file to write (default {OUTPUT.name} next to this script, the copy the repository holds)",
    )
    args = parser.parse_args(argv)
    args.output.write_text(render())
    print(f"wrote {args.output} ({len(KIND_COUNTS)} kinds, {sum(KIND_COUNTS.values())} samples)")


if __name__ == "__main__":
    main()
