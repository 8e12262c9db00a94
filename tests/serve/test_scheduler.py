"""The replica's decoding thread without Serve: concurrent requests interleaved round by
round give exactly target-only output, stream deltas add up to the final text, and one
request's failure or cancellation does not disturb the others."""

from __future__ import annotations

import pickle
import queue

import pytest

from draftlab.config import SamplingParams
from draftlab.decoding.engine import SpeculativeDecoder, autoregressive_generate
from draftlab.decoding.tree import load_tree
from draftlab.models.drafters.build import init_drafter
from draftlab.serve.events import Accepted, Delta, Done, EngineEvent, Failed
from draftlab.serve.policy import EXPLORE_EVERY, SpeculationPolicy
from draftlab.serve.scheduler import Scheduler


@pytest.fixture(scope="module")
def decoder(tiny):
    return SpeculativeDecoder(
        tiny, init_drafter("parallel", tiny, k=4, depth=1, seed=2), load_tree("small-6")
    )


def collect(sched: Scheduler, prompt, params, speculation=None):
    """Submit and return (events queue, ticket)."""
    q: queue.Queue = queue.Queue()
    return q, sched.submit(prompt, params, q.put, speculation)


def drain(q: queue.Queue, timeout: float = 60.0) -> list[EngineEvent]:
    events = []
    while True:
        e = q.get(timeout=timeout)
        events.append(e)
        if isinstance(e, Done | Failed):
            return events


def streamed(events: list[EngineEvent]) -> str:
    return "".join(e.text for e in events if isinstance(e, Delta))


def crossover_policy(rows: int) -> SpeculationPolicy:
    """Hand-set costs: a forward costs 10 ms up to 8 rows, then 10 ms per 8 rows; with
    tau 2 drafting a 7-row tree pays for two requests (2 x 10 > t(14) = 17.5) and not for
    three (2 x 10 < t(21) = 26.25)."""
    costs = {n: 10.0 * max(1, n / 8) for n in (1, 2, 4, 8, 16, 32, 64, 128)}
    return SpeculationPolicy(costs, rows, prior_tau=2.0, prior_draft_ms=0.0)


def test_policy_drafts_only_while_it_pays():
    p = crossover_policy(rows=7)  # small-6 tree: root + 6 nodes
    assert p.target_ms(12) == pytest.approx(15.0) and p.target_ms(256) == pytest.approx(320.0)
    assert p.speculate(1) and p.speculate(2) and p.break_even() == 3
    plain = [p.speculate(3) for _ in range(EXPLORE_EVERY * 2)]
    assert plain.count(True) == 2  # an exploratory drafting round every EXPLORE_EVERY rounds
    for _ in range(200):  # drafts are accepted all the time: tau rises towards 7
        p.observe(7.0, 0.0)
    assert p.tau > 6.9 and p.speculate(4)


@pytest.mark.parametrize(
    "speculation,max_active", [("on", 16), ("off", 16), ("auto", 2), ("auto", 16)]
)
def test_concurrent_requests_equal_target_only(
    tiny, tiny_prompts, decoder, speculation, max_active
):
    policy = crossover_policy(decoder.tree.num_nodes + 1)
    sched = Scheduler(decoder, speculation, max_active=max_active, policy=policy)
    params = SamplingParams(max_new_tokens=30)
    jobs = [collect(sched, ids, params) for ids in tiny_prompts * 3]  # 12 at once
    for (q, _), ids in zip(jobs, tiny_prompts * 3, strict=True):
        events = drain(q)
        ref = autoregressive_generate(tiny, ids, params)
        done = events[-1]
        assert streamed(events) == ref.text
        assert isinstance(done, Done) and all(isinstance(e, Delta) for e in events[:-1])
        assert done.completion_tokens == len(ref.tokens) and done.finish_reason == ref.finish_reason
        drafted_rounds = done.stats["drafted"] / decoder.tree.num_nodes
        if speculation == "off":
            assert drafted_rounds == 0
        elif speculation == "on" or max_active == 2:
            assert drafted_rounds > 0
        else:  # 12 requests at once: the policy's plain steps, bar exploration rounds
            assert drafted_rounds <= 1 + done.stats["rounds"] / EXPLORE_EVERY
    sched.shutdown()


def test_stop_string_is_never_streamed(tiny, tiny_prompts, decoder):
    ids = tiny_prompts[0]
    free = autoregressive_generate(tiny, ids, SamplingParams(max_new_tokens=40)).text
    stop = free[10:13]
    sched = Scheduler(decoder, "on")
    q, _ = collect(sched, ids, SamplingParams(max_new_tokens=40, stop=[stop]))
    text = streamed(drain(q))
    assert text == free[: free.find(stop)] and stop not in text
    sched.shutdown()


def test_cancelled_and_failing_requests_leave_the_others_alone(tiny, tiny_prompts, decoder):
    sched = Scheduler(decoder, "on", max_active=4)
    params = SamplingParams(max_new_tokens=30)
    q_bad, _ = collect(sched, [10**6], params)  # an id outside the vocabulary: the forward fails
    q_cancel, t_cancel = collect(sched, tiny_prompts[1], SamplingParams(max_new_tokens=2000))
    q_ok, _ = collect(sched, tiny_prompts[2], params)
    t_cancel.cancel()
    assert isinstance(drain(q_bad)[-1], Failed)
    assert streamed(drain(q_ok)) == autoregressive_generate(tiny, tiny_prompts[2], params).text
    assert sched.alive and sched.num_active == 0
    # the cancelled request was dropped: no more events, never finished, far from its 2000 tokens
    cancelled = []
    while not q_cancel.empty():
        cancelled.append(q_cancel.get_nowait())
    assert not any(isinstance(e, Done | Failed) for e in cancelled) and len(cancelled) < 2000
    assert t_cancel.session is None or not t_cancel.session.done
    sched.shutdown()
    assert not sched.alive


def test_shutdown_fails_what_cannot_finish(tiny_prompts, decoder):
    sched = Scheduler(decoder, "on", max_active=1)
    q_running, _ = collect(sched, tiny_prompts[0], SamplingParams(max_new_tokens=4000))
    q_waiting, _ = collect(sched, tiny_prompts[1], SamplingParams(max_new_tokens=5))
    sched.shutdown(timeout=0.5)
    assert drain(q_waiting)[-1] == Failed("the server is shutting down")
    assert isinstance(drain(q_running)[-1], Failed)
    assert not sched.alive
    with pytest.raises(RuntimeError, match="shutting down"):
        sched.submit(tiny_prompts[0], SamplingParams(), lambda e: None)


def test_a_seed_reproduces_a_sample_whatever_the_load(tiny_prompts, decoder):
    """Under `auto`, which rounds draft depends on the load; a seeded sample must not."""
    params = SamplingParams(max_new_tokens=25, temperature=1.0, seed=11)
    texts = []
    for load in (0, 5):  # alone, then beside 5 greedy requests that push the policy to plain steps
        sched = Scheduler(decoder, "auto", policy=crossover_policy(decoder.tree.num_nodes + 1))
        others = [
            collect(sched, tiny_prompts[1], SamplingParams(max_new_tokens=25)) for _ in range(load)
        ]
        q, _ = collect(sched, tiny_prompts[0], params)
        texts.append(streamed(drain(q)))
        for oq, _ in others:
            drain(oq)
        sched.shutdown()
    assert texts[0] == texts[1]


@pytest.mark.parametrize(
    "event",
    [
        Accepted(prompt_tokens=7),
        Delta(text="héllo", tokens=3),
        Done(
            finish_reason="length",
            stats={"rounds": 2, "tau": 1.5},
            completion_tokens=4,
            queued_s=0.01,
        ),
        Failed("boom"),
        Failed("too long", status=400, param="prompt", code="context_length_exceeded"),
    ],
)
def test_events_survive_pickling(event):
    """The events cross the Ray actor boundary (engine replica -> ingress) pickled."""
    again = pickle.loads(pickle.dumps(event))
    assert again == event and type(again) is type(event)
