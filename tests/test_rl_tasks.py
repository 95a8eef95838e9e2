"""Task registry, prompt formatting, answer extraction, rewards and the prompt sampler."""

import pytest

from specrl.data.tasks import (
    ANSWER_FORMATS,
    PromptFormatter,
    PromptSampler,
    extract_answer,
    generator_options,
    make_task,
    resolve_answer_format,
    score_response,
)
from specrl.errors import SpecRLError


class FakeTokenizer:
    """Character-level stand-in for a HF tokenizer with a ChatML template."""

    chat_template = "chatml"

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False):
        text = "".join(f"<|{m['role']}|>{m['content']}\n" for m in messages)
        return text + ("<|assistant|>" if add_generation_prompt else "")

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


@pytest.mark.parametrize("name", ["countdown", "basic_arithmetic", "chain_sum"])
def test_curated_tasks_build_and_score_gold(name):
    train, val = make_task(name, difficulty="easy", train_size=40, val_size=8, seed=3)
    assert len(val) == 8 and 0 < len(train) <= 40
    assert not {p.question for p in val} & {p.question for p in train}
    p = train[0]
    s = score_response(train, p, f"reasoning... <answer>{p.answer}</answer>")
    assert s.correct and s.formatted and s.reward == 1.0
    s = score_response(train, p, "no tags at all: 12345")
    assert not s.correct and not s.formatted and s.reward == 0.0


def test_splits_are_deterministic():
    a, _ = make_task("chain_sum", "medium", train_size=20, val_size=4, seed=1)
    b, _ = make_task("chain_sum", "medium", train_size=20, val_size=4, seed=1)
    c, _ = make_task("chain_sum", "medium", train_size=20, val_size=4, seed=2)
    assert [p.question for p in a] == [p.question for p in b]
    assert [p.question for p in a] != [p.question for p in c]


def test_format_weight():
    train, _ = make_task("chain_sum", "easy", train_size=10, val_size=2, seed=0)
    p = train[0]
    wrong = str(int(p.answer) + 1)
    s = score_response(train, p, f"<answer>{wrong}</answer>", format_weight=0.1)
    assert s.formatted and not s.correct and s.reward == pytest.approx(0.1)
    s = score_response(train, p, f"<answer>{p.answer}</answer>", format_weight=0.1)
    assert s.reward == pytest.approx(1.1)


def test_unknown_task_lists_valid_ones():
    with pytest.raises(SpecRLError, match=r"'chainsum'.*'chain_sum'.*countdown"):
        make_task("chainsum")


def test_bad_difficulty_and_options():
    with pytest.raises(SpecRLError, match=r"difficulty 'extreme'.*easy.*default"):
        generator_options("chain_sum", "extreme")
    with pytest.raises(SpecRLError, match="Did you mean 'max_terms'"):
        generator_options("chain_sum", "default", {"max_term": 3})
    with pytest.raises(SpecRLError, match="rejected its options"):
        make_task("chain_sum", "default", {"min_terms": 5, "max_terms": 2}, train_size=5, val_size=1)
    with pytest.raises(SpecRLError, match="train_size"):
        make_task("chain_sum", train_size=0)


def test_extract_answer():
    assert extract_answer("a <answer> 7 </answer> b <answer>-3</answer>") == "-3"
    assert extract_answer("<answer>\n1+2\n</answer>") == "1+2"
    assert extract_answer("Answer: 5") is None
    assert extract_answer("3 + 4 = 7, so -12.5 is it", "number") == "-12.5"
    assert extract_answer("<answer>9</answer> then 10", "number") == "9"
    assert extract_answer("no digits", "number") is None
    assert extract_answer("work\n 3*4+1 \n\n", "line") == "3*4+1"


def test_answer_format_resolution():
    assert resolve_answer_format("chain_sum", "auto") == "number"
    assert resolve_answer_format("countdown", "auto") == "tags"
    assert resolve_answer_format("countdown", "line") == "line"
    assert resolve_answer_format("chain_sum", "reasoning") == "reasoning"
    with pytest.raises(SpecRLError, match=rf"answer_format 'json'.*auto, {', '.join(ANSWER_FORMATS)}"):
        resolve_answer_format("chain_sum", "json")


def test_reasoning_format_reads_the_final_answer_not_the_working():
    # the working mentions other numbers after the stated answer; the reward reads what follows "answer is"
    reply = "First, 3 + 4 = 7. Then 7 - 2 = 5. So, the answer is 5.\n\nThis uses 2 steps of 1 operation."
    assert extract_answer(reply, "reasoning") == "5"
    assert extract_answer("the final Answer: **-12**. Done in 3 steps", "reasoning") == "-12"
    assert extract_answer("3 + 4 = 7, then 7 - 2 = 5", "reasoning") == "5"  # no stated answer: the last number
    assert extract_answer("steps 1 and 2 <answer>9</answer> then 4", "reasoning") == "9"  # tags win
    assert extract_answer("no digits at all", "reasoning") is None
    train, _ = make_task("chain_sum", "easy", train_size=10, val_size=2, seed=0)
    p = train[0]
    s = score_response(train, p, f"Let me add. The answer is {p.answer}. I used 3 steps.", answer_format="reasoning")
    assert s.correct and s.reward == 1.0
    assert ANSWER_FORMATS["reasoning"].startswith("Let's think step by step")


def test_number_format_reward():
    train, _ = make_task("chain_sum", "easy", train_size=10, val_size=2, seed=0)
    p = train[0]
    s = score_response(train, p, f"The sum is {p.answer}.", answer_format="number")
    assert s.correct and s.reward == 1.0
    s = score_response(train, p, "I don't know", answer_format="number")
    assert not s.formatted and s.reward == 0.0


def test_prompt_formatter_uses_chat_template():
    tok = FakeTokenizer()
    fmt = PromptFormatter(tok, system_prompt="SYS", instruction="Be brief.")
    seen = []
    real = tok.apply_chat_template
    tok.apply_chat_template = lambda messages, **k: seen.append((messages, k)) or real(messages, **k)
    text = fmt.text("What is 1+1?")
    assert seen == [([{"role": "system", "content": "SYS"}, {"role": "user", "content": "What is 1+1?\nBe brief."}],
                     {"add_generation_prompt": True, "tokenize": False})]
    assert text == real(*seen[0][0:1], **seen[0][1])  # the template's own rendering, with the assistant turn opened
    assert text.endswith("<|assistant|>")
    del tok.apply_chat_template
    assert PromptFormatter(tok, None, "").text("Q") == "<|user|>Q\n<|assistant|>"
    assert fmt.decode(fmt.encode("Q")) == fmt.text("Q")
    tok.chat_template = None
    with pytest.raises(SpecRLError, match="chat template"):
        PromptFormatter(tok)


def test_prompt_sampler_epochs_and_resume():
    s = PromptSampler(size=5, seed=7)
    first = s.next(5)
    assert sorted(first) == [0, 1, 2, 3, 4]
    nxt = s.next(3)
    r = PromptSampler(size=5, seed=7)
    r.load_state_dict({"cursor": 5, "seed": 7, "size": 5})
    assert r.next(3) == nxt
    with pytest.raises(SpecRLError, match="same task config"):
        r.load_state_dict({"cursor": 5, "seed": 8, "size": 5})


def test_basic_arithmetic_sums_preset_is_two_small_addends():
    import re

    from specrl.data.tasks import make_task

    train, val = make_task("basic_arithmetic", "sums", train_size=50, val_size=8, seed=0)
    for p in [*train.problems, *val.problems]:
        m = re.fullmatch(r"Calculate (\d+) \+ (\d+)\.", p.question)
        assert m, p.question
        assert int(p.answer) == int(m[1]) + int(m[2]) and max(int(m[1]), int(m[2])) <= 10
