"""A profile calibrated before the served decode fit took a lone request's step: its decode entry refitted with it.

    python bench/data/simulate/gpu-h100-2026-12-08/refit_served_single.py PROFILE OUT

The lone 2-token requests' decode step is read from the profile's own transfer source ("less its decode's steps
(median X ms, counters)": the decode engine's step seconds over each request, its one forward, which proposes no
draft, and the step that drops it) and their prompt length from the same sentence; the served rows, the
engine-alone fit and everything else are the profile's. `bench calibrate` now fits the same way itself.
"""

import json
import re
import sys

from bench.simulate.calibrate import FIT_TERMS, served_decode_fit, served_single_row


def main(src: str, out: str) -> None:
    p = json.load(open(src))
    key = next(x for x in p["engines"] if x.startswith("decode"))
    served = p["engines"][key]
    text = p["transfer"]["source"]
    step_ms = float(re.search(r"less its decode's steps \(median ([\d.]+) ms, counters\)", text).group(1))
    prompt = int(re.search(r"over 5 single (\d+)-token requests", text).group(1))
    one = served_single_row(step_ms / 1e3, prompt)
    rows = [(r[:-1], r[-1]) for r in served["measured"]]
    if len(rows[0][0]) == len(FIT_TERMS) - 1:  # written before the draft column: every served step proposes k
        rows = [([*f, 3.0], t) for f, t in rows]
    coef, rel = served_decode_fit(rows, served.get("engine_only"), one)
    before = {t: served.get(t, 0.0) for t in FIT_TERMS}
    served.update(dict(zip(FIT_TERMS, coef)), median_relative_error=rel,
                  measured=[[*f, t] for f, t in rows + [one]], steps=len(rows) + 1)
    print(f"{src}: lone step {step_ms:.1f} ms at {prompt} tokens")
    print("  before:", {t: round(v * 1e3, 4) for t, v in before.items()})
    print("  after: ", {t: round(v * 1e3, 4) for t, v in zip(FIT_TERMS, coef)}, f"median |error| {rel:.3f}")
    json.dump(p, open(out, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
