"""Train the output-length predictor from a history file and save it.

    python -m tdpipe.train_predictor history.jsonl -o predictor_dir [--feature minilm|hashing]

The history is JSONL, one `{"prompt": str, "output_len": int}` per served request.
A tenth of it is held out to report the model's mean absolute error against the
fallback (historical median), so a model that does not help is visible at once.
"""

from __future__ import annotations

import argparse
import sys

from pdserve.tdpipe.predictor import BucketPredictor, FallbackPredictor, load_history, mean_abs_error


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("history", help="JSONL of {prompt, output_len}")
    parser.add_argument("-o", "--output", required=True, help="directory to save the predictor in")
    parser.add_argument(
        "--feature",
        default="minilm",
        choices=["minilm", "hashing"],
        help="minilm needs the [predictor] extra; hashing needs nothing",
    )
    parser.add_argument("--epochs", type=int, default=200)
    args = parser.parse_args(argv)
    try:
        prompts, lengths = load_history(args.history)
        cut = max(1, len(prompts) // 10)
        model = BucketPredictor.train(prompts[cut:], lengths[cut:], args.feature, epochs=args.epochs)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    model.save(args.output)
    model_err = mean_abs_error(model, prompts[:cut], lengths[:cut])
    fallback_err = mean_abs_error(FallbackPredictor(lengths[cut:]), prompts[:cut], lengths[:cut])
    print(f"saved {args.output}: held-out MAE {model_err:.1f} tokens vs fallback (median) {fallback_err:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
