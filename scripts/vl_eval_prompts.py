"""Build a small evaluation set of real photographs with questions, for `eagle-eval` on a vision-language target.

The photographs are scikit-image's sample images (skimage/data/: public-domain or CC0 photographs shipped
inside its wheel), taken from an installed `skimage` or straight from a downloaded wheel, so the main venv
needs neither scikit-image nor its scipy dependency:

    pip download scikit-image --no-deps -d /tmp/skimage      # one 14 MB wheel
    python scripts/vl_eval_prompts.py --wheel /tmp/skimage/scikit_image-*.whl outputs/vl_prompts
    eagle-eval recipe=... eval.prompts=outputs/vl_prompts/prompts.jsonl eval.turns=all ...

It writes OUT/images/NAME and OUT/prompts.jsonl: 10 prompts, one photograph each, two user turns (a question
about the picture, then a follow-up), images named relative to the file. Small on purpose: 10 photographs are
enough to check losslessness and get a first acceptance figure, not a benchmark of visual questions.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import zipfile
from pathlib import Path

# (file in skimage/data, what it shows: the first turn's question, the follow-up)
PHOTOS: list[tuple[str, str, str]] = [
    ("astronaut.png", "Who or what is in this photograph, and what are they wearing?", "What is in the background?"),
    ("chelsea.png", "What animal is this, and what is it doing?", "Describe the colours of its fur."),
    ("coffee.png", "What is on the table in this picture?", "Is the drink hot or cold? Why do you think so?"),
    ("rocket.jpg", "Describe what is happening in this photograph.", "Where might this have been taken?"),
    ("motorcycle_left.png", "What vehicle is shown here?", "Describe its colours and parts."),
    ("camera.png", "What is the person in this photograph doing?", "Is the photograph in colour?"),
    ("coins.png", "What objects are in this image?", "How many of them can you count?"),
    ("moon.png", "What is shown in this image?", "What are the round marks on its surface called?"),
    ("hubble_deep_field.jpg", "What do you see in this picture?", "Why are some of the objects reddish?"),
    ("retina.jpg", "What kind of image is this?", "What are the dark branching lines?"),
]


def _skimage_data_dir() -> Path | None:
    spec = importlib.util.find_spec("skimage")
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent / "data"


def copy_photos(out: Path, wheel: Path | None) -> None:
    """The photographs into out/images, from the wheel (zip) or the installed package."""
    images = out / "images"
    images.mkdir(parents=True, exist_ok=True)
    if wheel is not None:
        with zipfile.ZipFile(wheel) as zf:
            for name, _, _ in PHOTOS:
                (images / name).write_bytes(zf.read(f"skimage/data/{name}"))
        return
    data = _skimage_data_dir()
    if data is None:
        sys.exit("scikit-image is not installed here: give --wheel PATH (pip download scikit-image --no-deps -d DIR)")
    for name, _, _ in PHOTOS:
        (images / name).write_bytes((data / name).read_bytes())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="output folder (images/ and prompts.jsonl)")
    parser.add_argument("--wheel", type=Path, default=None, help="a scikit-image wheel to read instead of the package")
    args = parser.parse_args()
    copy_photos(args.out, args.wheel)
    with open(args.out / "prompts.jsonl", "w") as f:
        for name, question, follow_up in PHOTOS:
            line = {
                "id": Path(name).stem,
                "turns": [question, follow_up],
                "images": [f"images/{name}"],
                "category": "photo",
            }
            f.write(json.dumps(line) + "\n")
    print(f"{len(PHOTOS)} prompts with photographs in {args.out / 'prompts.jsonl'}")


if __name__ == "__main__":
    main()
