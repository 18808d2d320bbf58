"""The continuous-batching engine: a request's tokens do not depend on what runs beside it (alone,
in batches of 8 and 64, with mixed lengths, arrivals mid-run and slots reused), finished rows
leave and waiting ones take their slots, a request that cannot fit fails alone."""
from __future__ import annotations

import gc
import sys
from pathlib import Path

import numpy as np
import pytest

from tilekernels.runtime import Engine, Request, Sampling, generate, load_tokenizer, text_pieces, warm_up

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpt2"))
from checkpoints import make_gpt2  # noqa: E402
from engine_runs import GREEDY, run  # noqa: E402

from gpt.model import GPT  # noqa: E402



@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_gpt2(tmp_path_factory.mktemp("engine"), n_positions=128)


def workload(rng, n: int, vocab: int, longest: int = 40, most_new: int = 30):
    """n requests of ragged prompts (1..longest tokens) and lengths (1..most_new new tokens)."""
    return [(rng.integers(0, vocab, rng.integers(1, longest + 1)).tolist(), int(rng.integers(1, most_new + 1)))
            for _ in range(n)]


def test_greedy_tokens_do_not_depend_on_the_batch(ckpt):
    rng = np.random.default_rng(0)
    model = GPT.load(ckpt)
    work = workload(rng, 70, model.config.vocab_size)
    alone = [run(Engine(model, 1), [w])[0] for w in work]
    assert [len(t) for t in alone] == [n for _, n in work]
    eight = Engine(model, 8)
    assert run(eight, work) == alone
    wide = Engine(model, 64, capacity=70)       # rows reach the end of their slots
    assert run(wide, work, arrive_every=2) == alone
    assert not wide.busy and sorted(wide.runner.slots.free) == list(range(64))


def test_logprobs_are_the_raw_models_at_any_batch(ckpt):
    """Each generated token's and each prompt token's logprob (and alternatives) equal log_softmax
    of the teacher-forced logits in float64 within 1e-5, whatever the sampling settings, alone
    and 64 at once; rows that ask for none get none; a prompt of embeddings cannot be scored."""
    rng = np.random.default_rng(3)
    model = GPT.load(ckpt)
    work = workload(rng, 64, model.config.vocab_size, longest=30, most_new=8)
    kinds = [Sampling(temperature=0.9, top_k=20, repetition_penalty=1.3, logprobs=4, prompt_logprobs=2),
             Sampling(temperature=0, logprobs=0), Sampling(temperature=0.7),
             Sampling(temperature=0.8, min_p=0.1, presence_penalty=0.5, frequency_penalty=0.5,
                      logit_bias=((5, 3.0),), logprobs=2),
             Sampling(temperature=0, frequency_penalty=1.0, logit_bias=((7, -100.0),), logprobs=1)]
    settings = [kinds[i % len(kinds)] for i in range(64)]

    from tilekernels.runtime import requests as make

    many = Engine(model, 64)
    reqs = [make(many, [work[i][0]], work[i][1], settings[i], i)[0] for i in range(64)]
    many.add(*reqs)
    while many.busy:
        many.step()
    one = Engine(model, 1)
    for i in range(0, 64, 7):
        a = generate(one, [work[i][0]], work[i][1], settings[i], seed=i)[0]
        assert a.tokens == reqs[i].out.tokens
        for mine, theirs in ((a.logprobs, reqs[i].out.logprobs), (a.prompt_logprobs, reqs[i].out.prompt_logprobs)):
            mine, theirs = [t for t in mine or [] if t], [t for t in theirs or [] if t]
            assert [(t.token, [k for k, _ in t.top]) for t in mine] == [(t.token, [k for k, _ in t.top]) for t in theirs]
            assert np.allclose([t.logprob for t in mine], [t.logprob for t in theirs], atol=1e-6)
    for i, r in enumerate(reqs):
        s, o = settings[i], r.out
        assert (o.logprobs is None) == (s.logprobs is None) and (o.prompt_logprobs is None) == (s.prompt_logprobs is None)
        seq = work[i][0] + o.tokens
        x = model.forward(np.array([seq]), np.arange(len(seq))[None], model.new_cache(1, len(seq)),
                          last_only=False)[0].astype(np.float64)
        ref = x - x.max(-1, keepdims=True)
        ref -= np.log(np.exp(ref).sum(-1, keepdims=True))
        n = len(work[i][0])
        places = [(j, t) for j, t in enumerate(o.prompt_logprobs or [])][1:] + \
            [(n + j, t) for j, t in enumerate(o.logprobs or [])]
        for j, t in places:
            assert t.token == seq[j] and abs(t.logprob - ref[j - 1, t.token]) <= 1e-5
            top = np.argsort(-ref[j - 1], kind="stable")[:len(t.top)]
            assert [k for k, _ in t.top] == top.tolist()
            assert np.allclose([v for _, v in t.top], ref[j - 1, top], atol=1e-5)
        assert all(len(t.top) == s.logprobs for t in o.logprobs or [])
    with pytest.raises(ValueError, match="prompt_logprobs needs"):
        many.add(Request([1, 2], 2, Sampling(prompt_logprobs=1), embeds=np.zeros((2, 32), np.float32)))
    with pytest.raises(ValueError, match="logprobs must be"):
        Sampling(logprobs=21)


def test_presence_frequency_penalties_and_logit_bias_as_openai_defines_them(ckpt):
    """Greedy decoding under presence and frequency penalties (counting generated tokens only)
    and a logit bias is the argmax of logits - frequency x count - presence x (count > 0) + bias
    at every step; a bias of 100 forces its token, -100 bans it."""
    model = GPT.load(ckpt)
    prompt = [3, 17, 17, 40, 2]
    s = Sampling(temperature=0, presence_penalty=0.7, frequency_penalty=0.4, logit_bias=((11, 1.5), (40, -2.0)))
    got = generate(Engine(model, 4), [prompt], 12, s, ignore_eos=True)[0].tokens
    seq, counts = list(prompt), np.zeros(model.config.vocab_size)
    bias = np.zeros(model.config.vocab_size)
    bias[[11, 40]] = [1.5, -2.0]
    for _ in range(12):
        x = model.forward(np.array([seq]), np.arange(len(seq))[None], model.new_cache(1, len(seq)))[0]
        t = int(np.argmax(x - 0.4 * counts - 0.7 * (counts > 0) + bias))
        seq.append(t)
        counts[t] += 1
    assert got == seq[len(prompt):] and len(set(got)) > 3
    forced = generate(Engine(model, 4), [prompt], 6, Sampling(temperature=0.9, logit_bias=((9, 100.0),)), seed=1,
                      ignore_eos=True)[0].tokens
    assert forced == [9] * 6
    greedy = generate(Engine(model, 4), [prompt], 6, Sampling(temperature=0), ignore_eos=True)[0].tokens
    banned = generate(Engine(model, 4), [prompt], 6, Sampling(temperature=0, logit_bias=((greedy[0], -100.0),)),
                      ignore_eos=True)[0].tokens
    assert greedy[0] not in banned
    with pytest.raises(ValueError, match="logit_bias: token ids"):
        Engine(model, 1).add(Request([1], 2, Sampling(logit_bias=((10 ** 6, 1.0),))))
    for bad in (dict(min_p=1.5), dict(presence_penalty=3.0), dict(logit_bias=((1, 101.0),))):
        with pytest.raises(ValueError):
            Sampling(**bad)


def test_a_flow_starts_only_for_rows_that_go_on_past_their_first_token(ckpt):
    """Decode steps are queued before the host has the first tokens: requests ending with their
    first start none; beside others, theirs stay as alone."""
    model = GPT.load(ckpt)
    engine = Engine(model, 4)
    work = [([5, 6, 7], 1), ([9], 1), ([3, 4], 1)]
    alone = [run(Engine(model, 1), [w])[0] for w in work]
    assert run(engine, work) == alone and [len(t) for t in alone] == [1, 1, 1]
    assert engine.flow is None and not engine.runner.decoders
    mixed = work + [([8, 1, 2], 6)]
    assert run(Engine(model, 4), mixed) == alone + [run(Engine(model, 1), [mixed[-1]])[0]]


def test_capacity_is_at_most_the_models_positions(ckpt):
    model = GPT.load(ckpt)
    assert Engine(model, 1).capacity == Engine(model, 1, capacity=4096).capacity == 128
    assert Engine(model, 1, capacity=50).capacity == 50


def test_sampled_rows_draw_from_their_own_seeds(ckpt):
    rng = np.random.default_rng(1)
    model = GPT.load(ckpt)
    work = workload(rng, 20, model.config.vocab_size)
    for s in (Sampling(temperature=0.9, top_k=20), Sampling(temperature=0, repetition_penalty=1.5),
              Sampling(temperature=1.2, top_p=0.8, repetition_penalty=1.3)):
        seeds = list(range(100, 120))
        alone = [run(Engine(model, 1), [w], s, [seed])[0] for w, seed in zip(work, seeds)]
        assert run(Engine(model, 8), work, s, seeds, arrive_every=1) == alone
        assert run(Engine(model, 64), work, s, seeds) == alone
    assert len({tuple(t) for t in alone}) > 10


def test_greedy_and_sampled_rows_share_a_batch(ckpt):
    """Requests with settings of their own (greedy, penalised, top-k, top-p) decode in one batch,
    each drawing what it draws alone."""
    rng = np.random.default_rng(2)
    model = GPT.load(ckpt)
    work = workload(rng, 24, model.config.vocab_size)
    kinds = [GREEDY, Sampling(temperature=0.9, top_k=20), Sampling(temperature=0, repetition_penalty=1.5),
             Sampling(temperature=1.2, top_p=0.8, repetition_penalty=1.3), Sampling(temperature=0.7)]
    settings = [kinds[i % len(kinds)] for i in range(len(work))]
    seeds = list(range(200, 224))
    alone = [run(Engine(model, 1), [w], [s], [seed])[0] for w, s, seed in zip(work, settings, seeds)]
    assert run(Engine(model, 8), work, settings, seeds, arrive_every=1) == alone
    assert run(Engine(model, 64), work, settings, seeds) == alone


def test_text_stop_strings_and_eos_per_request(ckpt):
    model, tok = GPT.load(ckpt), load_tokenizer(ckpt)
    prompts = [tok.encode(p).ids for p in ("To be", "the slings and arrows of", "Café", "whether 'tis")]
    kw = dict(sampling=Sampling(temperature=1.0, top_k=40), seed=7, stop=["e", "ou"], tokenizer=tok)
    alone = [generate(Engine(model, 1), [p], 20, **kw)[0] for p in prompts]
    together = generate(Engine(model, 3), prompts, 20, **kw)
    # each prompt draws from [seed, 0] (its first sample) wherever it sits: alone is the same
    assert [c.text for c in together] == [c.text for c in alone]
    assert [c.finish_reason for c in together] == [c.finish_reason for c in alone]
    assert 0 < sum(c.finish_reason == "stop" for c in together) < len(prompts)
    for c in together:
        assert not any(s in c.text for s in ("e", "ou"))


def test_a_request_that_cannot_fit_fails_alone(ckpt):
    model = GPT.load(ckpt)
    engine = Engine(model, 4, capacity=50)
    ok = Request([1, 2, 3], 10)
    engine.add(ok)
    with pytest.raises(ValueError, match="engine's 50 positions"):
        engine.add(Request(list(range(30)), 30))
    with pytest.raises(ValueError, match="128 positions"):
        engine.add(Request(list(range(100)), 40))
    with pytest.raises(ValueError, match="empty prompt"):
        engine.add(Request([], 4))
    for bad in (0, 129):
        with pytest.raises(ValueError, match="max_batch must be 1 to 128"):
            Engine(model, bad)
    while engine.busy:
        engine.step()
    assert ok.finished and len(ok.out.tokens) >= 1


def test_stopping_early_cancels_and_frees_the_slots(ckpt):
    model = GPT.load(ckpt)
    engine = Engine(model, 2)
    pieces = text_pieces(engine, [[1, 2], [3], [4, 5, 6]], 30, GREEDY, tokenizer=load_tokenizer(ckpt))
    next(pieces)
    pieces.close()
    assert not engine.busy and sorted(engine.runner.slots.free) == [0, 1]
    assert len(generate(engine, [[7, 8]], 5, ignore_eos=True)[0].tokens) == 5


def test_each_slot_holds_its_rows_keys_from_column_zero(ckpt):
    """A row's keys sit at its own positions in its slot (whenever it joined, whatever ran there
    before), and its length counts them."""
    model = GPT.load(ckpt)
    engine = Engine(model, 3, capacity=60)
    first = Request([5] * 30, 4)
    engine.add(first)
    engine.step()
    later = [Request([7, 8, 9], 20), Request([1] * 12, 20)]
    for r in later:
        engine.add(r)
    engine.step()
    slots = engine.runner.slots
    for r in later:
        assert slots.length[r.slot] == len(r.prompt) + len(r.out.tokens) - 1
    alone = Engine(model, 1, capacity=60)
    alone.add(Request([7, 8, 9], 20))
    alone.step()
    n = min(int(alone.runner.slots.length[0]), int(slots.length[later[0].slot]))
    assert n > 3
    np.testing.assert_allclose(alone.runner.slots.cache.k[:, 0, :, :n], slots.cache.k[:, later[0].slot, :, :n],
                               rtol=1e-6, atol=1e-7)


def test_a_bfloat16_cache_keeps_rows_independent(ckpt):
    """Keys and values cached in bfloat16 (precision bf16): still every row's tokens alone equal
    its tokens in a batch, and the cache holds bfloat16."""
    import tilekernels as tk

    rng = np.random.default_rng(4)
    model = GPT.load(ckpt)
    work = workload(rng, 12, model.config.vocab_size)
    alone = [run(Engine(model, 1, kv_dtype=tk.weights.BF16), [w])[0] for w in work]
    engine = Engine(model, 8, capacity=80, kv_dtype=tk.weights.BF16)
    assert engine.runner.slots.cache.k.dtype == tk.weights.BF16
    assert run(engine, work, arrive_every=1) == alone


def test_warm_up_builds_every_batch_size_and_leaves_the_engine_as_new(ckpt):
    """A server's warm-up: the decode steps of each batch size the engine can run (its buckets
    and max_batch), in each sampling mode asked for, exist before any request; afterwards the
    engine is idle, its slots free, and it decodes as a new one. What it built is frozen out of
    the garbage collector's full passes."""
    rng = np.random.default_rng(5)
    model = GPT.load(ckpt)
    work = workload(rng, 10, model.config.vocab_size)
    engine = Engine(model, 12)
    sampled = Sampling(temperature=0.8, top_k=200)
    gc.unfreeze()
    try:
        warm_up(engine, (GREEDY, sampled))
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
    built = {(rows, mode.draws, mode.top_k) for rows, mode in engine.runner.decoders}
    assert built == {(rows, s, s) for rows in (1, 2, 4, 8, 12) for s in (False, True)}
    assert not engine.busy and sorted(engine.runner.slots.free) == list(range(12))
    assert run(engine, work) == run(Engine(model, 12), work)


def test_a_flow_yields_to_waiting_requests_in_groups_or_after_a_while(ckpt):
    """A running flow is not broken (a prefill, a restarted flow) by each arrival: one waiting
    request beside 16 running rows waits, two join at the next step, and one alone joins once a
    free slot has waited ADMIT_WAIT_S. Their tokens are what they get alone all the same."""
    import time

    from tilekernels.runtime import scheduler as scheduler_module

    model = GPT.load(ckpt)
    engine = Engine(model, 32)
    for i in range(16):
        engine.add(Request([i + 1, 2, 3], 60))
    engine.step()
    assert len(engine.scheduler.running) == 16 and engine.flow is not None
    late = [Request([9, 8, 7, i], 40) for i in range(3)]
    engine.add(late[0])
    engine.step()
    assert list(engine.scheduler.waiting) == [late[0]]
    engine.add(late[1])
    engine.step()
    assert not engine.scheduler.waiting and len(engine.scheduler.running) == 18
    engine.add(late[2])
    engine.step()
    assert list(engine.scheduler.waiting) == [late[2]]
    time.sleep(scheduler_module.ADMIT_WAIT_S)
    engine.step()
    assert not engine.scheduler.waiting
    while engine.busy:
        engine.step()
    for r in late:
        assert r.out.tokens == run(Engine(model, 1), [(r.prompt, 40)])[0]


def test_a_row_that_ends_does_not_end_the_flow_while_requests_wait(ckpt):
    """17 rows at max_batch 17 and a request waiting: the first row to finish frees a slot, and the
    flow goes on (one joinable request is less than an eighth of 16 running rows, and no slot has
    waited ADMIT_WAIT_S yet) rather than restarting for it; it joins later, with its own tokens."""
    model = GPT.load(ckpt)
    engine = Engine(model, 17)
    rows = [Request([i + 1, 2, 3], 4 if i == 0 else 50) for i in range(17)]
    waiting = Request([9, 8, 7], 20)
    for r in rows + [waiting]:
        engine.add(r)
    while not rows[0].finished:
        engine.step()
    flow = engine.flow
    engine.step()
    assert list(engine.scheduler.waiting) == [waiting] and engine.flow is flow is not None
    while engine.busy:
        engine.step()
    assert waiting.out.tokens == run(Engine(model, 1), [(waiting.prompt, 20)])[0]


def test_replays_start_with_two_single_steps_then_chains():
    """A flow's first replays are single steps (cheap to launch, so the GPU starts at once), an even
    number of them so each chain starts from the first input buffer; every step is replayed once."""
    from tilekernels.runtime.graphs import CHAIN, chunk_sizes

    for steps in range(0, 5 * CHAIN):
        sizes = chunk_sizes(steps)
        assert sum(sizes) == steps and set(sizes) <= {1, CHAIN}
        if steps >= CHAIN + 2:
            assert sizes[:2] == [1, 1] and sizes.index(CHAIN) == 2
    assert chunk_sizes(63) == [1, 1] + [CHAIN] * 7 + [1] * 5


def test_a_client_sending_request_after_request_is_never_refused(ckpt):
    """A worker with room for one job at a time gives a job's rows back before its result wakes
    anyone: a next request sent the moment the result is set (here from the future's own
    callback) is taken, not refused with QueueFull (a 503 to a client sending one request after
    another)."""
    import asyncio

    from tilekernels.runtime.server import EngineJob, EngineWorker, Metrics, QueueFull

    async def chained() -> list:
        loop = asyncio.get_running_loop()
        worker = EngineWorker(Engine(GPT.load(ckpt), 1), 0, Metrics("chained"))
        taken = []

        def next_one(_):
            try:
                taken.append(worker.submit(EngineJob([Request([2], 2)], loop)))
            except QueueFull:
                taken.append(None)
        try:
            first = worker.submit(EngineJob([Request([1], 2)], loop))
            first.future.add_done_callback(next_one)
            await asyncio.wrap_future(first.future)
            while not taken:
                await asyncio.sleep(0.01)
            if taken[0] is not None:
                await asyncio.wrap_future(taken[0].future)
            return taken
        finally:
            worker.stop(5)

    assert None not in asyncio.run(chained())


def test_embeds_and_ids_in_one_prefill_each_get_their_own(ckpt):
    """A request given as input embeddings admitted beside one of token ids: each row is built
    from what its own request brings (the second's embeds were ignored, or the first's NaN), so
    both get their tokens alone; embeds of the wrong width are refused."""
    model = GPT.load(ckpt)
    emb = np.asarray(model.embed(np.array([[40, 41, 42, 43]]), np.arange(4)[None]))[0]

    def tokens(*reqs):
        engine = Engine(model, 4)
        engine.add(*reqs)
        while engine.busy:
            engine.step()
        return [r.out.tokens for r in reqs]

    embedded = lambda: Request([5, 6, 7, 8], 8, GREEDY, embeds=emb.copy())     # noqa: E731
    plain = lambda: Request([1, 2, 3], 8, GREEDY)                                # noqa: E731
    alone = tokens(embedded()) + tokens(plain())
    assert tokens(plain(), embedded())[::-1] == alone and tokens(embedded(), plain()) == alone
    with pytest.raises(ValueError, match="embeds must be"):
        Engine(model, 4).add(Request([5, 6, 7, 8], 8, GREEDY, embeds=emb[:, :-1].copy()))
