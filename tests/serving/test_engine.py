"""The serving engine: batch invariance, prefix cache, KV checksums, input validation.

Every check that outputs match compares against ``generate`` (the request alone, the ground
truth), tokens and the logits of every generated token bitwise, and each is shown able to
fail: with the non-invariant kernel, or with verification off.
"""

from __future__ import annotations

import hashlib
import random
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace

import pytest
import torch

from aftershock.reference_impl.serving.engine import (
    Engine,
    EngineConfig,
    Verify,
    generate,
    logits_digest,
)
from aftershock.reference_impl.serving.kvcache import PagedKVCache, chain_hashes
from aftershock.reference_impl.serving.model import GPT, ModelConfig, decode, encode, model_id

MODEL = ModelConfig()
SMALL = EngineConfig(num_blocks=64)  # the default kernel (block 16, tile 4), a smaller pool


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    # The kernels are tiny: OpenMP threads only spin against each other on a small CPU.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


@dataclass
class _Result:
    tokens: dict[int, int] = field(default_factory=dict)  # output index -> token
    logits: dict[int, torch.Tensor] = field(default_factory=dict)  # output index -> row
    finished: int = 0


@dataclass(frozen=True)
class _Req:
    rid: str
    prompt: list[int]
    max_tokens: int
    at_step: int = 0  # added before this step
    emitted: tuple[int, ...] = ()


def _drive(engine: Engine, requests: Sequence[_Req]) -> dict[str, _Result]:
    results = {r.rid: _Result() for r in requests}

    def record(rid: str, index: int, row: torch.Tensor) -> None:
        results[rid].logits[index] = row.clone()

    engine.on_logits = record
    step = 0
    pending = sorted(requests, key=lambda r: r.at_step)
    while pending or engine.has_work():
        while pending and pending[0].at_step <= step:
            r = pending.pop(0)
            engine.add(r.rid, r.prompt, r.max_tokens, r.emitted)
        for out in engine.step():
            result = results[out.request_id]
            assert out.index not in result.tokens, f"{out} emitted twice"
            result.tokens[out.index] = out.token
            result.finished += out.finished
        step += 1
    return results


_Truth = tuple[list[int], list[torch.Tensor]]  # tokens, and the logits row of each
_truth_cache: dict[tuple[tuple[int, ...], int, EngineConfig], _Truth] = {}


def _alone(prompt: Sequence[int], max_tokens: int, config: EngineConfig) -> _Truth:
    # Only the kernel's settings shape the ground truth; the pool and verify mode do not.
    kernel = EngineConfig(
        block_size=config.block_size,
        tile=config.tile,
        batch_invariant=config.batch_invariant,
        num_blocks=64,
    )
    key = (tuple(prompt), max_tokens, kernel)
    if key not in _truth_cache:
        logits: list[torch.Tensor] = []
        tokens = generate(prompt, max_tokens, MODEL, kernel, logits=logits)
        _truth_cache[key] = (tokens, [row.clone() for row in logits])
    return _truth_cache[key]


def _mismatches(
    results: dict[str, _Result], requests: Sequence[_Req], config: EngineConfig
) -> list[str]:
    """Requests whose tokens or logits differ (bitwise) from the request run alone."""
    bad = []
    for r in requests:
        tokens, logits = _alone(r.prompt, r.max_tokens, config)
        got = results[r.rid]
        first = len(r.emitted)
        assert sorted(got.tokens) == list(range(first, r.max_tokens)), f"{r.rid}: indices"
        assert got.finished == 1, f"{r.rid}: finished {got.finished} times"
        if list(r.emitted) != tokens[:first]:
            raise AssertionError(f"{r.rid}: emitted tokens are not the ground truth's")
        if [got.tokens[i] for i in range(first, r.max_tokens)] != tokens[first:]:
            bad.append(f"{r.rid}: tokens")
        elif not all(torch.equal(got.logits[i], logits[i]) for i in range(first, r.max_tokens)):
            bad.append(f"{r.rid}: logits")
    return bad


def _check_invariance(
    results: dict[str, _Result], requests: Sequence[_Req], invariant: bool, config: EngineConfig
) -> None:
    bad = _mismatches(results, requests, config)
    if invariant:
        assert bad == [], f"outputs depend on the batch: {bad}"
    else:
        # The same comparison, on the kernel whose split-K depends on the batch: it must
        # see a difference, or it could not see one in the invariant case either.
        assert bad, "the batched split-K kernel matched the single-request run bitwise"


PREFIX = _tokens(1, 40)
MIXED = [
    _Req("a", PREFIX + _tokens(2, 9), 6),
    _Req("b", PREFIX + _tokens(3, 20), 5),
    _Req("c", PREFIX[:17] + _tokens(4, 3), 7, at_step=1),
    _Req("d", _tokens(5, 33), 4, at_step=1),
    _Req("e", PREFIX + _tokens(6, 1), 6, at_step=3),
    _Req("f", _tokens(7, 5), 7, at_step=3),
    _Req("g", PREFIX[:32], 4, at_step=4),
]
MODES = [pytest.param(True, id="invariant"), pytest.param(False, id="batched_split_k")]


def _digest(row: torch.Tensor) -> str:
    """The logits digest as the docs define it, computed here without the engine's code:
    BLAKE2b-64 over the row's float32 values, little-endian."""
    data = struct.pack(f"<{row.numel()}f", *row.tolist())  # float32 -> float -> float32: exact
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def test_every_output_carries_the_digest_of_its_logits_row() -> None:
    engine = Engine(MODEL, SMALL)
    rows: dict[tuple[str, int], torch.Tensor] = {}
    engine.on_logits = lambda rid, index, row: rows.__setitem__((rid, index), row.clone())
    engine.add("a", _tokens(11, 20), 5)
    engine.add("b", _tokens(12, 33), 4)
    outputs = []
    while engine.has_work():
        outputs.extend(engine.step())
    assert len(outputs) == 9
    for out in outputs:
        assert out.digest == _digest(rows[(out.request_id, out.index)]), out
    assert len({out.digest for out in outputs}) == len(outputs)
    # One flipped bit of a row is another digest.
    row = rows[("a", 0)].clone()
    row.view(torch.int32)[7] ^= 1
    first = next(out for out in outputs if (out.request_id, out.index) == ("a", 0))
    assert logits_digest(rows[("a", 0)][None]) == [first.digest]
    assert logits_digest(row[None]) != [first.digest]


@pytest.mark.parametrize("invariant", MODES)
def test_engine_mixed_batch_matches_alone(invariant: bool) -> None:
    config = EngineConfig(num_blocks=64, batch_invariant=invariant)
    engine = Engine(MODEL, config)
    results = _drive(engine, MIXED)
    assert engine.stats().prefix_hit_tokens > 0  # later arrivals reuse the shared prefix
    _check_invariance(results, MIXED, invariant, config)


@pytest.mark.parametrize("invariant", MODES)
def test_engine_chunked_prefill_matches_alone(invariant: bool) -> None:
    # 7 prompt positions a step: prefills stop mid-tile and mid-block and go on next step.
    config = EngineConfig(num_blocks=64, batch_invariant=invariant, max_step_tokens=7)
    engine = Engine(MODEL, config)
    engine.add("x", MIXED[1].prompt, 2)
    assert engine.step() == []  # 7 of its 60 positions: no token yet
    assert engine.stats().computed_tokens == 7
    engine.abort("x")
    results = _drive(engine, MIXED[:4])
    _check_invariance(results, MIXED[:4], invariant, config)


@pytest.mark.parametrize("invariant", MODES)
def test_engine_preemption_recompute_matches_alone(invariant: bool) -> None:
    # 7 blocks of 16 slots for four requests that need 3 blocks each: sequences are
    # preempted as they grow, and recompute from their tokens when readmitted.
    config = EngineConfig(num_blocks=7, batch_invariant=invariant)
    requests = [
        _Req("p0", PREFIX[:26], 12),
        _Req("p1", _tokens(11, 24), 12),
        _Req("p2", PREFIX[:20] + _tokens(12, 6), 11),
        _Req("p3", _tokens(13, 25), 12, at_step=2),
    ]
    engine = Engine(MODEL, config)
    results = _drive(engine, requests)
    stats = engine.stats()
    assert stats.preemptions > 0
    assert stats.recomputed_tokens > 0
    _check_invariance(results, requests, invariant, config)


@pytest.mark.parametrize("invariant", MODES)
def test_engine_migrated_request_matches_alone(invariant: bool) -> None:
    config = EngineConfig(num_blocks=64, batch_invariant=invariant)
    prompt = PREFIX[:27]
    truth, _ = _alone(prompt, 12, config)
    requests = [
        _Req("other", _tokens(21, 30), 8),
        # Five tokens were delivered by a worker that died; this one re-prefills them.
        _Req("moved", prompt, 12, at_step=2, emitted=tuple(truth[:5])),
        _Req("late", PREFIX[:20], 6, at_step=3),
    ]
    engine = Engine(MODEL, config)
    results = _drive(engine, requests)
    # Nothing of the moved request was cached here: its 5 emitted tokens were computed again.
    assert engine.stats().recomputed_tokens == 5
    _check_invariance(results, requests, invariant, config)


def test_a_reprefill_through_the_batched_kernel_keeps_tokens_but_not_logits() -> None:
    """The ``reprefill_not_invariant`` variant (a migrated request's emitted tokens re-prefilled
    through the batched split-K kernel): the next tokens are the ground truth's, the logits
    they are chosen from are not. Only a bitwise comparison of the logits sees it."""
    config = EngineConfig(num_blocks=64)
    requests = []
    for i in range(6):
        prompt = PREFIX[: 17 + 3 * i]
        truth, _ = _alone(prompt, 10, config)
        requests.append(_Req(f"moved{i}", prompt, 10, at_step=i, emitted=tuple(truth[:4 + i])))
    for broken in (False, True):
        engine = (_broken("reprefill_not_invariant") if broken else Engine)(MODEL, config)
        bad = _mismatches(_drive(engine, requests), requests, config)
        if broken:
            assert bad == [f"{r.rid}: logits" for r in requests]  # all: yet no token changed
        else:
            assert bad == []


def test_engine_migration_reuses_the_prefix_cache() -> None:
    prompt = PREFIX[:35]
    truth, _ = _alone(prompt, 20, SMALL)
    engine = Engine(MODEL, SMALL)
    # The same request ran here before (e.g. on its first attempt): its blocks are cached.
    _drive(engine, [_Req("first", prompt, 20)])
    before = engine.stats()
    moved = _Req("moved", prompt, 20, emitted=tuple(truth[:12]))
    results = _drive(engine, [moved])
    after = engine.stats()
    # prompt + 12 emitted = 47 tokens: the 2 full blocks come from the cache, only the
    # block holding the last token is computed, and only its emitted tokens count as redone.
    assert after.prefix_hit_tokens - before.prefix_hit_tokens == 32
    assert after.recomputed_tokens - before.recomputed_tokens == 47 - 35
    assert _mismatches(results, [moved], SMALL) == []


def test_prefix_cache_hits_for_a_shared_prefix() -> None:
    engine = Engine(MODEL, SMALL)
    requests = [_Req("a", [*PREFIX, 1], 4), _Req("b", [*PREFIX, 2, 3], 4, at_step=1)]
    results = _drive(engine, requests)
    stats = engine.stats()
    assert stats.prefix_hit_tokens == 32  # b found a's two full blocks of the 40-token prefix
    assert stats.prefix_hit_rate == 32 / (41 + 42)
    assert stats.computed_tokens == 41 + (42 - 32) + 2 * 3
    assert _mismatches(results, requests, SMALL) == []


def test_the_checksums_cpu_is_counted_where_it_is_spent() -> None:
    """``checksum_ms``: the engine thread's CPU in sealing and verifying. With ``read`` every
    step verifies the running requests' blocks, so a long decode spends a measurable amount;
    with ``off`` nothing is summed and the counter stays 0."""
    counted = {}
    for verify in ("read", "off"):
        engine = Engine(MODEL, replace(SMALL, verify=verify))
        engine.cache.checksum_ns = 0
        _drive(engine, [_Req(f"r{i}", [*PREFIX, i], 60) for i in range(4)])
        counted[verify] = engine.cache.checksum_ns
        assert engine.stats().checksum_ms == counted[verify] // 1_000_000
    assert counted["read"] > 0
    assert counted["off"] == 0


def test_prefix_cache_keys_are_chained() -> None:
    x, y, z = _tokens(31, 16), _tokens(32, 16), _tokens(33, 16)
    engine = Engine(MODEL, SMALL)
    _drive(engine, [_Req("xy", [*x, *y, 0], 2)])
    y_after_x = chain_hashes(engine.model_id, x + y, 16)[1]
    y_after_z = chain_hashes(engine.model_id, z + y, 16)[1]
    assert len(engine.cache.lookup([y_after_x])) == 1
    # The same 16 tokens after another prefix have other KV: not a hit, even looked up alone.
    assert engine.cache.lookup([y_after_z]) == []
    _drive(engine, [_Req("zy", [*z, *y, 0], 2)])
    assert engine.stats().prefix_hit_tokens == 0
    _drive(engine, [_Req("xz", [*x, *z, 0], 2)])
    assert engine.stats().prefix_hit_tokens == 16  # only the block of x


def test_prefix_cache_keys_differ_by_model() -> None:
    prompt = [*PREFIX, 0]
    other = ModelConfig(seed=1)
    assert model_id(other) != model_id(MODEL)
    engine = Engine(MODEL, SMALL)
    _drive(engine, [_Req("a", prompt, 2)])
    mine = chain_hashes(model_id(MODEL), prompt, 16)
    theirs = chain_hashes(model_id(other), prompt, 16)
    assert len(engine.cache.lookup(mine)) == 2
    assert engine.cache.lookup(theirs) == []
    assert not set(mine) & set(theirs)


def _flip(block: torch.Tensor, element: int, bit: int) -> None:
    words = block.view(-1).view(torch.int32)
    words[element] ^= (1 << bit) if bit < 31 else -(1 << 31)


def test_checksum_catches_every_single_bit_flip() -> None:
    engine = Engine(MODEL, SMALL)
    _drive(engine, [_Req("a", [*PREFIX, 0], 2)])
    block = engine.cache.lookup(chain_hashes(engine.model_id, PREFIX, 16))[1]
    view = engine.kv[block]
    n = view.numel()
    for element in (0, 1, n // 2 + 7, n - 1):
        for bit in range(32):  # 0: lowest mantissa bit, 30: top exponent bit, 31: sign
            _flip(view, element, bit)
            assert engine.cache.verify([block]) == [block], (element, bit)
            _flip(view, element, bit)
            assert engine.cache.verify([block]) == []


@pytest.mark.parametrize("pattern", ["one run", "gaps summed through", "far apart",
                                     "more runs than are summed in place"])
def test_verify_names_exactly_the_changed_blocks_it_was_asked_about(pattern: str) -> None:
    """However the asked-for blocks lie in the pool (runs, short gaps summed through, long
    gaps, too many runs to sum in place), ``verify`` names exactly the sealed ones among them
    whose bytes changed: never a changed block it was not asked about, nor an unsealed one."""
    cache = PagedKVCache(MODEL, 420, 16)
    for _ in range(400):
        assert cache.extend("s")
    cache.kv.normal_(generator=torch.Generator().manual_seed(0))
    cache.seal([("s", [7] * (399 * 16), 399 * 16)])  # every block but the last is sealed
    table = cache.table("s")
    asked = {"one run": table[100:140], "gaps summed through": table[0:200:3],
             "far apart": table[5:400:40], "more runs than are summed in place": table[::9],
             }[pattern] + [table[399]]  # and the unsealed last block
    assert cache.verify(asked) == []
    rng = random.Random(pattern)
    changed = sorted(rng.sample(table, 60))
    for block in changed:
        _flip(cache.kv[block], rng.randrange(cache.kv[block].numel()), rng.randrange(32))
    want = sorted(set(changed) & set(asked) - {table[399]})
    assert want, "the pattern must ask about some changed block"
    assert cache.verify(asked) == want
    assert cache.verify(reversed(asked)) == want  # any order, the same answer


SHARED = PREFIX + _tokens(41, 8)  # 48 tokens: three full blocks every sharer holds
BITS = [pytest.param(30, id="exponent_bit30"), pytest.param(0, id="mantissa_bit0")]


def _poison_scenario(config: EngineConfig, bit: int, newcomer: bool) -> tuple[
    Engine, dict[str, _Result], list[_Req], list[tuple[int, str, str]], int
]:
    """``b`` reuses ``a``'s cached SHARED prefix; then a bit of their most shared block flips.

    With ``newcomer``, a third request with the same prefix arrives right after the flip.
    """
    requests = [_Req("a", [*SHARED, 1], 7), _Req("b", SHARED + _tokens(42, 5), 7)]
    engine = Engine(MODEL, config)
    failures: list[tuple[int, str, str]] = []
    engine.on_checksum_failure = lambda block, rid, where: failures.append((block, rid, where))
    results = {r.rid: _Result() for r in requests}

    def record(rid: str, index: int, row: torch.Tensor) -> None:
        results[rid].logits[index] = row.clone()

    engine.on_logits = record
    steps = flipped = 0
    while steps < 2 or engine.has_work():
        if steps < 2:
            r = requests[steps]
            engine.add(r.rid, r.prompt, r.max_tokens)
        if steps == 3:
            block = engine.shared_prefix_block()
            assert block is not None
            flipped = engine.cache.most_shared()
            assert flipped == engine.cache.table("a")[0]  # all 3 are shared: the lowest id
            _flip(block, 5, bit)
            if newcomer:
                requests.append(_Req("c", [*SHARED, 9, 9], 6))
                results["c"] = _Result()
                engine.add("c", [*SHARED, 9, 9], 6)
        for out in engine.step():
            results[out.request_id].tokens[out.index] = out.token
            results[out.request_id].finished += out.finished
        steps += 1
    return engine, results, requests, failures, flipped


@pytest.mark.parametrize("bit", BITS)
@pytest.mark.parametrize("verify", ["hit", "off"])
def test_poisoned_prefix_block_is_caught_on_a_hit(bit: int, verify: Verify) -> None:
    config = EngineConfig(num_blocks=64, verify=verify)
    engine, results, requests, failures, flipped = _poison_scenario(config, bit, newcomer=True)
    stats = engine.stats()
    if verify == "off":
        # Nothing notices, and the poisoned block is read: the check above is needed.
        assert stats.checksum_failures == 0
        assert failures == []
        assert _mismatches(results, requests, config)
        return
    assert stats.checksum_failures == 1
    assert failures == [(flipped, "c", "hit")]
    # The bad block (the first of the shared prefix) and the two chained after it.
    assert stats.evicted_blocks == 3
    # a and b held the bad block: they dropped their KV from it on and recomputed it.
    assert stats.recomputed_tokens >= 2 * len(SHARED)
    assert _mismatches(results, requests, config) == []


@pytest.mark.parametrize("bit", BITS)
@pytest.mark.parametrize("verify", ["read", "hit"])
def test_poisoned_block_in_use_is_caught_on_read(bit: int, verify: Verify) -> None:
    config = EngineConfig(num_blocks=64, verify=verify)
    engine, results, requests, failures, flipped = _poison_scenario(config, bit, newcomer=False)
    stats = engine.stats()
    if verify == "hit":
        # No new request wants the block, so "hit" never looks at it while a and b read it.
        assert stats.checksum_failures == 0
        assert _mismatches(results, requests, config)
        return
    assert stats.checksum_failures == 1
    assert failures in ([(flipped, "a", "read")], [(flipped, "b", "read")])
    assert stats.evicted_blocks == 3
    assert _mismatches(results, requests, config) == []


def test_lru_evicts_the_tail_of_a_released_chain_first() -> None:
    cache = PagedKVCache(MODEL, num_blocks=4, block_size=16)
    tokens = _tokens(61, 32)
    assert cache.extend("a")
    assert cache.extend("a")
    cache.seal([("a", tokens, 32)])
    chain = chain_hashes(cache.model_id, tokens, 16)
    assert cache.lookup(chain) == cache.table("a")
    cache.free("a")
    assert cache.available() == 4  # released but still cached: evictable
    for _ in range(3):  # two free blocks, then the least recently released cached one
        assert cache.extend("b")
    assert cache.lru_evictions == 1
    assert len(cache.lookup(chain)) == 1  # the head, which more prompts share, survives
    assert cache.extend("b")
    assert cache.lookup(chain) == []
    assert not cache.extend("b")  # the pool is exhausted


def test_shared_prefix_block_is_a_view_of_the_most_shared_block() -> None:
    engine = Engine(MODEL, SMALL)
    assert engine.shared_prefix_block() is None
    engine.add("a", [*SHARED, 1], 4)
    engine.step()
    assert engine.shared_prefix_block() is None  # cached, but held by one request only
    engine.add("b", [*SHARED, 2], 4)
    engine.step()
    block = engine.shared_prefix_block()
    assert block is not None
    ids = engine.cache.lookup(chain_hashes(engine.model_id, SHARED, 16))
    assert torch.equal(block, engine.kv[min(ids)])
    block.view(-1)[0] = 123.0
    assert engine.kv[min(ids)].view(-1)[0] == 123.0  # a view, not a copy


def _broken(variant: str) -> type[Engine]:
    """An Engine subclass with a test-only broken variant of
    tests/serving/broken/sitecustomize.py applied."""
    import importlib.util
    import types
    from pathlib import Path

    path = Path(__file__).resolve().parent / "broken" / "sitecustomize.py"
    spec = importlib.util.spec_from_file_location("_broken_serving_variants", path)
    assert spec is not None
    assert spec.loader is not None
    variants = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(variants)
    namespace = types.SimpleNamespace(Engine=type(f"Engine_{variant}", (Engine,), {}))
    getattr(variants, variant)(namespace)
    return namespace.Engine  # type: ignore[no-any-return]


@pytest.mark.parametrize("broken", [False, True], ids=["verified", "unverified_hits"])
def test_a_poisoned_idle_prefix_block_is_caught_on_its_next_hit(broken: bool) -> None:
    """A cached block no request holds (its requests finished) goes bad. ``verify="read"``
    never reads it while it is idle: only the next hit's verification stands between it
    and the next request with that prefix. Without it, that request reads the bad KV."""
    config = EngineConfig(num_blocks=64)  # verify="read", the default
    engine = (_broken("unverified_hits") if broken else Engine)(MODEL, config)
    assert engine.idle_prefix_block() is None
    _drive(engine, [_Req("a", [*SHARED, 1], 3), _Req("b", [*SHARED, 2], 3, at_step=1)])
    head = engine.cache.lookup(chain_hashes(engine.model_id, SHARED, 16))[0]
    # b's hit went to all three blocks of SHARED; of the tie, the most recently released
    # (chains are released tail first): the head, which every prompt with the prefix reads.
    block = engine.idle_prefix_block()
    assert block is not None
    assert block.data_ptr() == engine.kv[head].data_ptr()
    _flip(block, 5, 30)
    failures: list[tuple[int, str, str]] = []
    engine.on_checksum_failure = lambda b, rid, where: failures.append((b, rid, where))
    _drive(engine, [_Req("other", _tokens(77, 20), 3)])  # steps that do not read the block
    assert failures == []  # idle: "read" does not see it
    results = _drive(engine, [_Req("c", [*SHARED, 9, 9], 6)])
    if broken:  # "read" sees it one step late: c's first token came from the bad KV
        assert [(b, where) for b, _, where in failures] == [(head, "read")]
        assert _mismatches(results, [_Req("c", [*SHARED, 9, 9], 6)], config)
    else:
        assert failures == [(head, "c", "hit")]
        assert _mismatches(results, [_Req("c", [*SHARED, 9, 9], 6)], config) == []


def test_abort_frees_blocks_and_unknown_id_is_a_noop() -> None:
    engine = Engine(MODEL, SMALL)
    engine.add("a", PREFIX, 5)
    engine.add("b", PREFIX[:10], 5)
    engine.add("c", _tokens(51, 10), 5)
    assert engine.running() == ["a", "b", "c"]
    engine.step()
    engine.abort("b")
    engine.abort("nope")
    assert engine.running() == ["a", "c"]
    engine.abort("a")
    engine.abort("c")
    assert not engine.has_work()
    assert engine.step() == []
    assert engine.cache.available() == SMALL.num_blocks  # cached blocks are evictable
    engine.add("a", PREFIX, 5)  # the id can be reused once it is gone


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "emitted", "match"),
    [
        ([], 4, (), "empty prompt"),
        ([1, 2], 0, (), "max_tokens=0"),
        ([1, 2], 3, (5, 6, 7), "nothing left"),
        ([1, 256], 3, (), r"prompt\[1\]=256"),
        ([1, -1], 3, (), r"prompt\[1\]=-1"),
        ([1, 2], 3, (300,), r"emitted\[0\]=300"),
        ([1] * 1000, 25, (), "max_seq"),
    ],
)
def test_add_rejects_bad_requests(
    prompt: list[int], max_tokens: int, emitted: tuple[int, ...], match: str
) -> None:
    engine = Engine(MODEL, EngineConfig(num_blocks=8))
    with pytest.raises(ValueError, match=match):
        engine.add("r", prompt, max_tokens, emitted)
    assert not engine.has_work()


def test_add_rejects_duplicates_and_requests_larger_than_the_pool() -> None:
    engine = Engine(MODEL, EngineConfig(num_blocks=8))
    engine.add("r", [1, 2], 3)
    with pytest.raises(ValueError, match="already in the engine"):
        engine.add("r", [3], 3)
    with pytest.raises(ValueError, match="does not fit the KV pool"):
        engine.add("big", [1] * 100, 30)  # 129 slots > 8 blocks of 16
    with pytest.raises(ValueError, match="tile=3 does not divide"):
        EngineConfig(tile=3)


def test_model_weights_follow_the_seed_and_tokens_are_bytes() -> None:
    a, b, c = GPT(MODEL), GPT(MODEL), GPT(ModelConfig(seed=1))
    for (name, pa), pb, pc in zip(
        a.named_parameters(), b.parameters(), c.parameters(), strict=True
    ):
        assert torch.equal(pa, pb), name
        if pa.std() > 0:  # layer-norm weights and biases are constants
            assert not torch.equal(pa, pc), name
    text = "héllo ✓"
    tokens = encode(text)
    assert tokens == list(text.encode("utf-8"))
    assert len(decode(tokens)) == len(tokens)  # one character per token, whatever the bytes
    assert decode(tokens).encode("latin-1").decode("utf-8") == text


def test_the_engine_bench_runs_both_workloads_and_says_what_read_costs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`python -m aftershock.reference_impl.serving.engine` (bench/results/serving-notes-2026-12.md
    quotes it): each workload, each mode, and verify=read against off."""
    from aftershock.reference_impl.serving.engine import _bench

    threads = torch.get_num_threads()
    try:
        _bench(repeats=1)
    finally:
        torch.set_num_threads(threads)  # the bench pins this process to one thread
    out = capsys.readouterr().out
    assert "shared: 16 requests, at most 16 at a time" in out
    assert "served: 64 requests, at most 8 at a time" in out
    assert out.count("verify=read against off:") == 2
    assert out.count("checksums") == 10
