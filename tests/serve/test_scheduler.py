"""The replica's decoding thread without Serve: concurrent requests interleaved round by
round give exactly target-only output, stream deltas add up to the final text, and one
request's failure or cancellation does not disturb the others."""

from __future__ import annotations

import queue

import pytest

from draftlab.config import SamplingParams
from draftlab.decoding.engine import SpeculativeDecoder, autoregressive_generate
from draftlab.decoding.tree import load_tree
from draftlab.models.drafters import init_drafter
from draftlab.serve.scheduler import Scheduler


@pytest.fixture(scope="module")
def decoder(tiny):
    return SpeculativeDecoder(tiny, init_drafter("parallel", tiny, k=4, depth=1, seed=2), load_tree("small-6"))


def collect(sched: Scheduler, prompt, params, speculation=None):
    """Submit and return (events queue, ticket)."""
    q: queue.Queue = queue.Queue()
    return q, sched.submit(prompt, params, q.put, speculation)


def drain(q: queue.Queue, timeout: float = 60.0) -> list[dict]:
    events = []
    while True:
        e = q.get(timeout=timeout)
        events.append(e)
        if "done" in e or "error" in e:
            return events


@pytest.mark.parametrize("speculation,max_active", [("on", 16), ("off", 16), ("auto", 2)])
def test_concurrent_requests_equal_target_only(tiny, tiny_prompts, decoder, speculation, max_active):
    sched = Scheduler(decoder, speculation, auto_max_active=1, max_active=max_active)
    params = SamplingParams(max_new_tokens=30)
    jobs = [collect(sched, ids, params) for ids in tiny_prompts * 3]  # 12 at once
    for (q, _), ids in zip(jobs, tiny_prompts * 3, strict=True):
        events = drain(q)
        ref = autoregressive_generate(tiny, ids, params)
        done = events[-1]
        assert "".join(e.get("delta", "") for e in events) == ref.text
        assert done["completion_tokens"] == len(ref.tokens) and done["finish_reason"] == ref.finish_reason
        if speculation == "off":
            assert done["stats"]["drafted"] == 0
        elif speculation == "on":
            assert done["stats"]["drafted"] > 0
    sched.shutdown()


def test_stop_string_is_never_streamed(tiny, tiny_prompts, decoder):
    ids = tiny_prompts[0]
    free = autoregressive_generate(tiny, ids, SamplingParams(max_new_tokens=40)).text
    stop = free[10:13]
    sched = Scheduler(decoder, "on")
    q, _ = collect(sched, ids, SamplingParams(max_new_tokens=40, stop=[stop]))
    events = drain(q)
    streamed = "".join(e.get("delta", "") for e in events)
    assert streamed == free[: free.find(stop)] and stop not in streamed
    sched.shutdown()


def test_cancelled_and_failing_requests_leave_the_others_alone(tiny, tiny_prompts, decoder):
    sched = Scheduler(decoder, "on", max_active=4)
    params = SamplingParams(max_new_tokens=30)
    q_bad, _ = collect(sched, [10**6], params)  # an id outside the vocabulary: the forward fails
    q_cancel, t_cancel = collect(sched, tiny_prompts[1], SamplingParams(max_new_tokens=2000))
    q_ok, _ = collect(sched, tiny_prompts[2], params)
    t_cancel.cancel()
    assert "error" in drain(q_bad)[-1]
    events = drain(q_ok)
    assert "".join(e.get("delta", "") for e in events) == autoregressive_generate(tiny, tiny_prompts[2], params).text
    assert sched.alive and sched.num_active == 0
    sched.shutdown()
    assert not sched.alive


def test_shutdown_fails_what_cannot_finish(tiny_prompts, decoder):
    sched = Scheduler(decoder, "on", max_active=1)
    q_running, _ = collect(sched, tiny_prompts[0], SamplingParams(max_new_tokens=4000))
    q_waiting, _ = collect(sched, tiny_prompts[1], SamplingParams(max_new_tokens=5))
    sched.shutdown(timeout=0.5)
    assert drain(q_waiting)[-1] == {"error": "the server is shutting down"}
    assert "error" in drain(q_running)[-1]
    assert not sched.alive
    with pytest.raises(RuntimeError, match="shutting down"):
        sched.submit(tiny_prompts[0], SamplingParams(), lambda e: None)
