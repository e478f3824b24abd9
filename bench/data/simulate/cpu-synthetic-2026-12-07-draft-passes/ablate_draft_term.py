"""A profile's decode entries refitted without the draft-pass term (its feature set to 0): the ablation.

    python bench/data/simulate/cpu-synthetic-2026-12-07-draft-passes/ablate_draft_term.py PROFILE OUT
"""

import json
import sys

from bench.simulate.calibrate import FIT_TERMS, nnls_fit, served_decode_fit


def main(src: str, out: str) -> None:
    p = json.load(open(src))
    key = next(x for x in p["engines"] if x.startswith("decode"))
    served = p["engines"][key]
    eo = served["engine_only"]
    coef, rel = nnls_fit([([*r[:-2], 0.0], r[-1]) for r in eo["measured"]], relative=True)
    eo2 = dict(zip(FIT_TERMS, coef))
    print("engine alone without the term:", {t: round(c, 7) for t, c in eo2.items()},
          f"median |error| {eo['median_relative_error']:.3f} -> {rel:.3f}")
    scoef, _ = served_decode_fit([([*r[:-2], 0.0], r[-1]) for r in served["measured"]], eo2)
    served.update(dict(zip(FIT_TERMS, scoef)), engine_only={**eo, **eo2, "median_relative_error": rel})
    print("served without the term:", {t: round(c, 7) for t, c in zip(FIT_TERMS, scoef)})
    json.dump(p, open(out, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
