"""The check the fault tests apply to a stream that moved (chaos.assert_stream_matches): a greedy or seeded
stream may part from the undisturbed run only where the reference's choice was a near-tie, and must match again
after it. Against the offline engine (the seeded race reproduces its draws) and against a scripted stand-in
whose logits put a near-tie where the test wants one."""

from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from engine.runner.sampler import keyed_exponentials
from tests.helpers import chaos

PROMPT = list(range(100, 160))
SEEDED = {"prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "seed": 1234}


def _reference(offline, body: dict) -> list[int]:
    params = SamplingParams(max_tokens=body["max_tokens"], temperature=body.get("temperature", 0.0),
                            seed=body.get("seed"), ignore_eos=True)
    return list(offline.generate([body["prompt"]], params)[0].token_ids)


def test_the_seeded_race_is_the_engines_draw(offline):
    got = _reference(offline, SEEDED)
    for p, token in enumerate(got):
        assert int(chaos._race(offline, SEEDED, PROMPT + got[:p]).argmax()) == token, p
    chaos.assert_stream_matches(offline, SEEDED, got)


@pytest.mark.parametrize("body", [SEEDED, {"prompt": PROMPT, "max_tokens": 8}], ids=["seeded", "greedy"])
def test_a_token_changed_at_a_clear_margin_fails(offline, body):
    got = _reference(offline, body)
    score = chaos._race(offline, body, PROMPT + got[:3])
    wrong = int(score.argmin())  # the least likely token: far from a tie
    with pytest.raises(AssertionError, match="not a near-tie"):
        chaos.assert_stream_matches(offline, body, got[:3] + [wrong] + got[4:])
    with pytest.raises(AssertionError, match="served 7 tokens"):
        chaos.assert_stream_matches(offline, body, got[:7])


class _Scripted:
    """An offline engine over a vocabulary of 8 whose logits after a sequence are a fixed function of its length
    and last token, with tokens 2 and 5 a near-tie (0.001 apart) after exactly `tie_at` tokens: in the logits, or
    (seed) in the race of that seed's draw there; generate draws as the engine's sampler does (argmax, or the
    exponential race keyed on seed and position, at temperature 1)."""

    V = 8

    def __init__(self, tie_at: int, seed: int | None = None):
        self.tie_at, self.seed = tie_at, seed

    def prompt_logits(self, tokens: list[int]) -> torch.Tensor:
        n = len(tokens)
        row = torch.tensor([((n * 7 + tokens[-1] * 3 + v * 5) % 11) * 0.7 for v in range(self.V)])
        if n == self.tie_at:
            noise = torch.zeros(self.V)
            if self.seed is not None:
                noise = torch.log(keyed_exponentials(torch.tensor([self.seed]), torch.tensor([n]), self.V)[0])
            row[2], row[5] = 20.0 + noise[2], 20.001 + noise[5]
        return row[None, :]

    def generate(self, prompts, params):
        out = []
        for prompt in prompts:
            toks = list(prompt)
            for _ in range(params.max_tokens):
                last = self.prompt_logits(toks)[-1]
                if params.temperature:
                    e = keyed_exponentials(torch.tensor([params.seed]), torch.tensor([len(toks)]), self.V)[0]
                    last = last / params.temperature - torch.log(e)
                toks.append(int(last.argmax()))
            out.append(type("Out", (), {"token_ids": toks[len(prompt):]})())
        return out


@pytest.mark.parametrize("body", [{"prompt": [1, 2, 3], "max_tokens": 6},
                                  {"prompt": [1, 2, 3], "max_tokens": 6, "temperature": 1.0, "seed": 7}],
                         ids=["greedy", "seeded"])
def test_a_near_tie_flips_and_the_stream_matches_again(body):
    fake = _Scripted(tie_at=5, seed=body.get("seed"))  # at the third output token (3 prompt tokens, 2 out)
    want = fake.generate([body["prompt"]], SamplingParams(max_tokens=6, temperature=body.get("temperature", 0.0),
                                                          seed=body.get("seed"), ignore_eos=True))[0].token_ids
    assert want[2] in (2, 5)
    flipped = 7 - want[2]  # the other candidate of the tie
    head = want[:2] + [flipped]
    rest = fake.generate([body["prompt"] + head], SamplingParams(max_tokens=3, temperature=body.get("temperature", 0.0),
                                                                 seed=body.get("seed"), ignore_eos=True))[0].token_ids
    chaos.assert_stream_matches(fake, body, head + rest)
    with pytest.raises(AssertionError, match="not a near-tie"):  # the flip's continuation must match too
        bad = head + [(t + 1) % fake.V for t in rest]
        chaos.assert_stream_matches(fake, body, bad)
