"""The OpenAI shapes of pipespec's outputs (pipespec.serving.openai_responses): logprobs as chat and
completions take them (always valid JSON), one head per request's chunks, and the per-pair
speculative-decoding block of the usage (vLLM's fields)."""

from __future__ import annotations

import json
import math

from pipespec.protocol.logprobs import TokenLogprobs
from pipespec.protocol.stats import PairStats, RequestStats
from pipespec.requests.outputs import Delta
from pipespec.serving.openai_responses import (
    ChatShape,
    ChoiceTally,
    Head,
    TokenNames,
    chat_logprobs,
    completion_logprobs,
    envelope,
    speculative_decoding,
    usage,
)

ENTRIES = [TokenLogprobs(7, -0.5, (7, 3), (-0.5, -1.5)), TokenLogprobs(3, -math.inf, (9,), (-0.1,))]


class Letters:
    """A tokenizer whose token i is the i-th letter."""

    def decode(self, ids):
        return "".join(chr(ord("a") + i) for i in ids)


def test_chat_logprobs_name_each_token_with_its_bytes():
    got = chat_logprobs(ENTRIES, TokenNames(Letters()))
    assert got["content"][0] == {
        "token": "h",
        "logprob": -0.5,
        "bytes": [ord("h")],
        "top_logprobs": [
            {"token": "h", "logprob": -0.5, "bytes": [ord("h")]},
            {"token": "d", "logprob": -1.5, "bytes": [ord("d")]},
        ],
    }
    assert got["content"][1]["logprob"] == -9999.0  # -inf: JSON has none


def test_completion_logprobs_and_token_ids_without_a_tokenizer():
    got = completion_logprobs(ENTRIES, TokenNames(None), offset=4)
    assert got == {
        "tokens": ["token_id:7", "token_id:3"],
        "token_logprobs": [-0.5, -9999.0],
        "top_logprobs": [{"token_id:7": -0.5, "token_id:3": -1.5}, {"token_id:9": -0.1}],
        "text_offset": [4, 4 + len("token_id:7")],
    }


def test_logprobs_that_are_not_numbers_json_takes_are_sent_within_its_range():
    odd = [TokenLogprobs(1, math.nan, (1, 2), (math.inf, -math.inf))]
    chat = chat_logprobs(odd, TokenNames(None))
    completion = completion_logprobs(odd, TokenNames(None), 0)
    assert [chat["content"][0]["logprob"], *(t["logprob"] for t in chat["content"][0]["top_logprobs"])] == [-9999.0, 0.0, -9999.0]
    assert completion["token_logprobs"] == [-9999.0]
    json.dumps([chat, completion], allow_nan=False)  # raises on NaN or an infinity


def test_every_chunk_of_a_request_carries_its_head():
    shape, head = ChatShape(TokenNames(None), False), Head("chatcmpl-1", 1700000000, "m")
    chunks = [envelope(shape, head, [shape.opening(0)], True), envelope(shape, head, [], True, {"total_tokens": 1})]
    assert {(c["id"], c["created"], c["model"], c["object"]) for c in chunks} == {
        ("chatcmpl-1", 1700000000, "m", "chat.completion.chunk")
    }
    assert "usage" not in chunks[0] and chunks[1]["usage"] == {"total_tokens": 1}


def pair(drafter: str, steps: list[tuple[int, int]]) -> PairStats:
    stats = PairStats(drafter, "target")
    for drafted, accepted in steps:
        stats.record(drafted, accepted)
    return stats


def test_the_speculative_block_has_vllms_fields():
    stats = pair("tiny", [(4, 0), (4, 2), (3, 3), (4, 2)])
    assert speculative_decoding(stats, num_spec_tokens=4) == {
        "drafter": "tiny",
        "verifier": "target",
        "mean_acceptance_length": 1 + 7 / 4,
        "draft_acceptance_rate": 7 / 15,
        "acceptance_histogram": [1, 0, 2, 1, 0],  # steps accepting exactly 0, 1, 2, 3, 4 drafts
        "num_spec_steps": 4,
        "num_accepted_draft_tokens": 7,
        "num_draft_tokens": 15,
        "num_spec_tokens": 4,
        "num_accepted_tokens_per_pos": [3, 3, 1],
    }


def test_usage_counts_the_prompt_once_and_sums_the_choices_pairs():
    tallies = []
    for i, steps in enumerate([[(2, 1)], [(2, 2), (2, 0)]]):
        tally = ChoiceTally(i)
        tally.add(Delta("ab", (1, 2)))
        tally.add(Delta("", (), "stop", RequestStats(5, 2, 0.1, 0.1, [pair("tiny", steps)], [])))
        tallies.append(tally)
    got = usage(5, tallies, {"tiny": 2})
    assert (got["prompt_tokens"], got["completion_tokens"], got["total_tokens"]) == (5, 4, 9)
    [block] = got["speculative_decoding"]
    assert (block["num_spec_steps"], block["num_draft_tokens"], block["num_accepted_draft_tokens"]) == (3, 6, 3)
    assert block["acceptance_histogram"] == [1, 1, 1] and block["num_accepted_tokens_per_pos"] == [2, 1]
