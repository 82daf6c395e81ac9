"""Structured outputs: the constraint kinds, bad constraints as clear errors, the bitmask layout, and
exactness under speculation (greedy speculation == greedy decoding under the same constraint; sampled
tokens follow the target's distribution under the mask, checked against enumeration)."""

from __future__ import annotations

import json
import re

import pytest
import torch
import transformers

from specserve import LLM, SamplingParams, SpecserveError
from specserve.config import StructuredOutputsParams
from specserve.core.batch import PieceResult
from specserve.structured.grammar import GrammarCompiler
from specserve.structured.masks import allowed_tokens
from specserve.structured.schema import admits_a_value, embed, json_size
from tests.server_harness import make_client
from tests.test_lossless import chi_square_pvalue
from tests.tiny_models import build_reference, save_byte_tokenizer, save_tiny_chat_model

pytestmark = pytest.mark.kernel_agnostic

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "n": {"type": "integer"}},
    "required": ["name", "n"],
    "additionalProperties": False,
}
CONSTRAINTS = {
    "choice": {"choice": ["yes", "no", "maybe so"]},
    "regex": {"regex": r"[a-c]{2,5}-\d{2}"},
    "json": {"json": SCHEMA, "disable_any_whitespace": True},  # random models pad JSON with newlines
    "json_object": {"json_object": True, "disable_any_whitespace": True},
}


def check(kind: str, text: str) -> None:
    if kind == "choice":
        assert text in CONSTRAINTS["choice"]["choice"]
    elif kind == "regex":
        assert re.fullmatch(CONSTRAINTS["regex"]["regex"], text), text
    else:
        value = json.loads(text)
        assert isinstance(value, dict)
        if kind == "json":
            assert set(value) == {"name", "n"} and isinstance(value["n"], int) and len(value["name"]) <= 6


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    return str(save_tiny_chat_model("qwen3", tmp_path_factory.mktemp("chat")))


def constrained(kind: str, temperature: float = 0.0, **kwargs) -> SamplingParams:
    return SamplingParams(
        temperature=temperature, max_tokens=48, structured_outputs=CONSTRAINTS[kind], **kwargs
    )


def test_bitmask_layout_is_llguidances():
    words = torch.tensor([[0b101, -(1 << 31)], [0, 1]], dtype=torch.int32)  # bit 31: the sign bit
    allowed = allowed_tokens(words, 70)
    assert allowed[0].nonzero().flatten().tolist() == [0, 2, 63]
    assert allowed[1].nonzero().flatten().tolist() == [32]  # ids past the words are never allowed


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_every_constraint_kind_holds(kind, chat_dir):
    llm = LLM(chat_dir, max_model_len=128)
    outs = llm.generate(
        ["Answer:"] * 3, [constrained(kind), constrained(kind, 1.0, seed=1), constrained(kind, 1.0, seed=2)]
    )
    for out in outs:
        completion = out.outputs[0]
        # every token was allowed where it was sampled: a fresh matcher takes them all
        grammar = llm.engine.grammars.compile(StructuredOutputsParams(**CONSTRAINTS[kind]))
        assert all(grammar.accept(t) for t in completion.token_ids)
        if kind != "json_object":  # a random model's open object may run to max_tokens
            assert completion.finish_reason == "stop", completion
            check(kind, completion.text)


SPECS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1},
    "draft_model_self": "self",  # the target drafting for itself: drafts accepted, grammar or not
    "draft_model_other": "other",  # a different random model: drafts the grammar refuses, and rejected ones
}


@pytest.fixture(scope="module")
def other_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("other")
    build_reference("qwen3", seed=1).save_pretrained(directory)
    return str(save_byte_tokenizer(directory))


@pytest.mark.parametrize("spec_name", list(SPECS))
@pytest.mark.parametrize("kind", ["choice", "regex", "json"])
def test_greedy_speculation_equals_greedy_decoding_under_a_constraint(kind, spec_name, chat_dir, other_dir):
    spec = SPECS[spec_name]
    if spec in ("self", "other"):
        spec = {
            "method": "draft_model",
            "model": chat_dir if spec == "self" else other_dir,
            "num_speculative_tokens": 3,
        }
    prompts = ["Answer:", "abcabcabc", "[1, 2, 3"]
    plain = LLM(chat_dir, max_model_len=128).generate(prompts, constrained(kind))
    llm = LLM(chat_dir, max_model_len=128, speculative_config=spec)
    speculative = llm.generate(prompts, constrained(kind))
    assert [o.outputs[0].token_ids for o in speculative] == [o.outputs[0].token_ids for o in plain]
    assert llm.engine.spec_stats.num_drafts > 0
    for out in speculative:
        check(kind, out.outputs[0].text)


def test_bad_constraints_are_clear_errors(chat_dir, tiny_model_dir):
    llm = LLM(chat_dir, max_model_len=64)
    with pytest.raises(SpecserveError, match="structured_outputs.json: .*objectx"):
        llm.generate(["x"], SamplingParams(structured_outputs={"json": {"type": "objectx"}}))
    with pytest.raises(SpecserveError, match="structured_outputs.regex"):
        llm.generate(["x"], SamplingParams(structured_outputs={"regex": "(unclosed"}))
    with pytest.raises(SpecserveError, match="exactly one constraint"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(SpecserveError, match="unknown keys \\['jsn'\\]"):
        SamplingParams(structured_outputs={"jsn": {}})
    with pytest.raises(SpecserveError, match="non-empty list"):
        StructuredOutputsParams(choice=[])
    for flags in ({"json_object": "no"}, {"regex": "a", "disable_any_whitespace": 1}):
        with pytest.raises(SpecserveError, match="must be true or false") as refused:
            SamplingParams(structured_outputs=flags)
        assert refused.value.param == f"structured_outputs.{next(k for k in flags if k != 'regex')}"
    no_tokenizer = LLM(str(tiny_model_dir("qwen3")), max_model_len=64)
    with pytest.raises(SpecserveError, match="need the model's tokenizer"):
        no_tokenizer.generate([[5, 6]], SamplingParams(structured_outputs={"choice": ["a"]}))


# ---- losslessness: sampled tokens against the exact target distribution under the mask ----------------
LETTERS = "abcdefghijk"  # ids 5..15 of a 16-token vocabulary
REGEX = r"[a-e][a-k][f-k]"  # each position's allowed letters do not depend on the earlier ones


def letter_model(directory, seed: int, logit_scale: float):
    from tests.test_lossless import make_model

    model = make_model(directory, seed, logit_scale)
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    specials = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    vocab = {token: i for i, token in enumerate(specials)} | {c: 5 + i for i, c in enumerate(LETTERS)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="</s>", pad_token="<pad>"
    ).save_pretrained(directory)
    return model


@torch.no_grad()
def exact_masked_joint(reference, prompt: list[int], params: SamplingParams) -> dict:
    """P(x1, x2, x3) under the regex's per-position letter sets, by enumeration with transformers."""
    from specserve.layers.sampler import SamplingBatch, target_probs

    sets = [LETTERS[:5], LETTERS, LETTERS[5:]]
    masks = [torch.tensor([i - 5 >= 0 and LETTERS[i - 5] in s for i in range(16)]) for s in sets]
    joint = {(): 1.0}
    for mask in masks:
        grown = {}
        for prefix, p in joint.items():
            logits = reference(torch.tensor([prompt + list(prefix)])).logits[:, -1].float()
            batch = SamplingBatch.build([params], [prompt], [list(prefix)], 16)
            probs = target_probs(logits.masked_fill(~mask, float("-inf")), batch)[0]
            for x in range(16):
                if probs[x] > 0:
                    grown[(*prefix, x)] = p * float(probs[x])
        joint = grown
    return joint


def letters_only(log_probs: torch.Tensor) -> torch.Tensor:
    """A planted bigram that, like the grammar, never proposes a special token (ids 0..4)."""
    return log_probs.index_fill(1, torch.arange(5), -30.0).log_softmax(-1)


@pytest.fixture(scope="module")
def letter_drafters(tmp_path_factory):
    """(reference, target dir, name -> speculative config): a draft model (the target at a higher
    temperature), a DSpark drafter with a planted bigram under the load-aware planner, and EAGLE-3."""
    from specserve.spec_decode.cost_profile import CostProfile
    from tests.test_lossless import V, bigram_log_probs
    from tests.tiny_models import save_tiny_drafter

    target_dir, draft_dir = tmp_path_factory.mktemp("target"), tmp_path_factory.mktemp("draft")
    reference = letter_model(target_dir, 0, 60.0)
    letter_model(draft_dir, 0, 15.0)
    dspark_dir, eagle3_dir = tmp_path_factory.mktemp("dspark"), tmp_path_factory.mktemp("eagle3")
    save_tiny_drafter(
        target_dir,
        dspark_dir,
        mask_token_id=V - 1,
        block_size=3,
        head_scale=0.02,
        markov_bias=letters_only(bigram_log_probs(reference)) * 0.7,
    )
    save_tiny_drafter(target_dir, eagle3_dir, head_scale=0.02, eagle3=True)
    # Step time 1 + 0.0002 B: with thousands of requests the planner verifies fewer drafts than it has.
    profile = CostProfile([1, 4096], [1.0002, 1 + 0.0002 * 4096]).save(
        tmp_path_factory.mktemp("cost") / "p.json"
    )
    return (
        reference,
        str(target_dir),
        {
            "draft_model": {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 2},
            "dspark_scheduled": {
                "method": "dspark",
                "model": str(dspark_dir),
                "verify_policy": "dspark",
                "cost_profile": str(profile),
            },
            "eagle3": {"method": "eagle3", "model": str(eagle3_dir), "num_speculative_tokens": 2},
        },
    )


# EAGLE-3 shares every grammar path with the others (masks on target rows, proposals cut by the grammar)
# and drafts slowly here: slow tier.
@pytest.mark.parametrize(
    "drafter", ["draft_model", "dspark_scheduled", pytest.param("eagle3", marks=pytest.mark.slow)]
)
def test_speculative_sampling_under_a_constraint_matches_the_masked_target(drafter, letter_drafters):
    reference, target_dir, specs = letter_drafters
    prompt = [5, 9, 6, 14]
    params = SamplingParams(temperature=1.0, max_tokens=3, structured_outputs={"regex": REGEX})
    llm = LLM(
        target_dir,
        max_model_len=64,
        max_num_seqs=1024,
        max_num_batched_tokens=8192,
        speculative_config=specs[drafter],
    )
    n = 6000
    outs = llm.generate([prompt] * n, params)
    counts: dict = {}
    for o in outs:
        counts[tuple(o.outputs[0].token_ids)] = counts.get(tuple(o.outputs[0].token_ids), 0) + 1
    stats = llm.engine.spec_stats
    assert 0.05 < stats.acceptance_rate < 0.95, stats  # drafts accepted and rejected
    assert chi_square_pvalue(counts, exact_masked_joint(reference, prompt, params), n) > 0.001


# ---- the OpenAI server ----------------------------------------------------------------------------------
def test_the_server_maps_response_format_and_structured_outputs(chat_dir):
    import openai

    from tests.server_harness import MODEL_NAME, running_server

    messages = [{"role": "user", "content": "Give me JSON."}]
    engine_llm = LLM(chat_dir, max_model_len=256)
    with running_server(chat_dir, max_model_len=256) as srv:
        client = make_client(srv.url)
        ask = dict(model=MODEL_NAME, messages=messages, max_tokens=48, temperature=0.0)
        for response_format, constraint in [
            (
                {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA, "strict": True}},
                {"json": SCHEMA},
            ),
            ({"type": "json_object"}, {"json_object": True}),
        ]:
            reply = client.chat.completions.create(response_format=response_format, **ask)
            expected = engine_llm.chat(
                messages, SamplingParams(temperature=0.0, max_tokens=48, structured_outputs=constraint)
            )
            assert reply.choices[0].message.content == expected[0].outputs[0].text
            grammar = engine_llm.engine.grammars.compile(StructuredOutputsParams(**constraint))
            assert all(grammar.accept(t) for t in expected[0].outputs[0].token_ids)
        reply = client.chat.completions.create(extra_body={"structured_outputs": CONSTRAINTS["json"]}, **ask)
        assert reply.choices[0].finish_reason == "stop"
        check("json", reply.choices[0].message.content)
        with pytest.raises(openai.BadRequestError, match="response_format.json_schema.schema: .*objectx"):
            client.chat.completions.create(
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "p", "schema": {"type": "objectx"}},
                },
                **ask,
            )
        with pytest.raises(openai.BadRequestError, match="give one of them"):
            client.chat.completions.create(
                response_format={"type": "json_object"},
                extra_body={"structured_outputs": {"regex": "a"}},
                **ask,
            )
        with pytest.raises(openai.BadRequestError, match="unknown keys"):
            client.completions.create(
                model=MODEL_NAME, prompt="x", extra_body={"structured_outputs": {"jsn": 1}}
            )


# ---- JSON schemas as users write them ---------------------------------------------------------------------
def test_an_embedded_schema_keeps_its_references():
    schema = {
        "$defs": {"A": {"type": "string"}},
        "properties": {
            "a": {"$ref": "#/$defs/A"},
            "again": {"$ref": "#"},
            "remote": {"$ref": "https://example.com/s.json"},
            "data": {"const": {"$ref": "#"}},  # a value, not a reference
        },
    }
    embedded = embed(schema, "/anyOf/0/properties/arguments")
    properties = embedded["properties"]
    assert properties["a"] == {"$ref": "#/anyOf/0/properties/arguments/$defs/A"}
    assert properties["again"] == {"$ref": "#/anyOf/0/properties/arguments"}
    assert properties["remote"] == {"$ref": "https://example.com/s.json"}
    assert properties["data"] == {"const": {"$ref": "#"}}
    assert schema["properties"]["a"] == {"$ref": "#/$defs/A"}  # the original is untouched


NODE = {"type": "object", "properties": {"next": {"$ref": "#"}}}


@pytest.mark.parametrize(
    "schema, has_value",
    [
        ({"$ref": "#"}, False),
        ({**NODE, "required": ["next"]}, False),  # every node needs another
        (NODE, True),  # a list that may end
        ({"type": "array", "items": {"$ref": "#"}}, True),  # [] ends it
        ({"type": "array", "items": {"$ref": "#"}, "minItems": 1}, False),
        ({"anyOf": [{"$ref": "#"}, {"type": "null"}]}, True),
        ({"allOf": [{"$ref": "#/$defs/x"}], "$defs": {"x": {"$ref": "#"}}}, False),
        ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, False),
        ({"$ref": "#/$defs/missing"}, True),  # llguidance reports that one itself
        ({"properties": {"x": {"$ref": "#"}}, "required": ["x"]}, True),  # no "type": a number will do
        ({"enum": [{"x": 1}], "$ref": "#"}, True),  # values given outright
        (False, False),
    ],
)
def test_schemas_that_no_finite_value_satisfies_are_found(schema, has_value):
    assert admits_a_value(schema) is has_value


def test_json_size_counts_compact_json_until_past_the_limit():
    value = {"type": "object", "enum": ["ab", "é", 1.5, None, True, [1, {"k": "v"}]]}
    exact = len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())
    assert json_size(value, 10**6) == exact
    assert json_size(["x" * 100] * 10**6, 1000) > 1000


def test_a_schema_that_matches_nothing_is_a_clear_error(chat_dir):
    llm = LLM(chat_dir, max_model_len=64)
    with pytest.raises(SpecserveError, match="structured_outputs.json: no JSON value satisfies"):
        llm.generate(["x"], SamplingParams(structured_outputs={"json": {"$ref": "#"}}))
    with pytest.raises(SpecserveError, match="structured_outputs.grammar: matches no text"):
        llm.generate(["x"], SamplingParams(structured_outputs={"grammar": "start: /[^\\x00-\\U0010FFFF]/"}))


def test_draft_masks_past_the_end_of_a_constraint_leave_the_matcher_where_it_was(chat_dir):
    # A matcher that has stopped takes the end-of-sequence token without recording it: rolling back the
    # masks' tokens must not count it, or it undoes a token the request committed.
    llm = LLM(chat_dir, max_model_len=64)
    y, e, s = llm.engine.tokenizer.encode("yes", add_special_tokens=False)
    eos = min(llm.engine.eos_token_ids)
    for masks in (lambda g: g.masks([e, s, eos]), lambda g: g.mask_after([e, s, eos])):
        grammar = llm.engine.grammars.compile(StructuredOutputsParams(choice=["yes", "no"]))
        assert grammar.accept(y)
        masks(grammar)
        assert grammar.accept(e) and grammar.accept(s) and grammar.finished


def test_a_tokenizer_llguidance_refuses_fails_constrained_requests_only(chat_dir):
    tokenizer = transformers.AutoTokenizer.from_pretrained(chat_dir)
    compiler = GrammarCompiler(tokenizer, len(tokenizer) - 1, frozenset())  # fewer ids than tokens
    compiler.prepare()  # a server that prepares it still starts
    for _ in range(2):
        with pytest.raises(SpecserveError, match="not available with this model's tokenizer .*vocab size"):
            compiler.compile(StructuredOutputsParams(regex="a"))


def test_a_token_the_matcher_refuses_ends_the_request_with_the_matchers_reason(chat_dir):
    llm = LLM(chat_dir, max_model_len=64)
    grammar = llm.engine.grammars.compile(StructuredOutputsParams(choice=["yes", "no"]))
    seq = llm.engine.make_sequence([1, 2], SamplingParams(max_tokens=4))
    seq.grammar = grammar
    (z,) = llm.engine.tokenizer.encode("z", add_special_tokens=False)
    _, update = llm.engine.output_processor.append(seq, PieceResult([z]))
    assert update.finished and update.outputs[0].finish_reason == "error"
    assert update.error.startswith(f"token {z} broke the request's output constraint (Parser Error: token")
    assert "satisfy the grammar" in update.error and "non-verbose" not in update.error
