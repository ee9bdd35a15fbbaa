"""Teach a small chat model pig latin with LoRA SFT, through the plain Tinker SDK.

The task is small and made up so that the change is easy to see: the script asks the base model to
translate a few English words into pig latin ("pig latin" -> "ig-pay atin-lay"), words it will never
train on plus a couple it will; fine-tunes a LoRA adapter for a hundred steps on ~1,700 words from a
built-in list (answer tokens only); then asks the same questions again and prints both sets of
answers next to the correct ones. With SmolLM2-135M-Instruct it takes about four minutes on two
CPU cores: the base model gets none right; the tuned one most, and applies the rule to nearly all.

It only uses the ``tinker`` SDK, so it runs unchanged against tinsmith or any Tinker service::

    TINKER_API_KEY=tml-anything python examples/sft_pig_latin.py --base-url http://127.0.0.1:8000

(tinsmith accepts any key that starts with ``tml-``). ``make demo`` starts a private tinsmith and
runs this script against it; see ``examples/demo.py``.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import tinker
from tinker import types
from tqdm import tqdm

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
QUESTION = "Translate to pig latin: {}"

# The training vocabulary: about 1,700 common English words. Many different words matter more than
# many steps: with a few hundred, a small model memorizes them instead of learning the rule.
_TRAIN_TEXT = """
    able about above accept across act actor add address adult afraid after afternoon again age
    agree ahead air airport alarm album alive all allow almost alone along already also always
    amount and anger angle angry animal ankle answer any apart appear apple april area argue
    arm army around arrive arrow art artist ask asleep attack aunt autumn avoid awake away baby
    back bacon bad badge bag bake bakery balance ball balloon band bank bar bark barn base
    basket bath battle beach bean bear beard beat beauty because become bed bee beef before
    begin behind believe bell belt bench bend berry best better between bicycle big bike bill
    bird birth bite bitter black blade blame blank blanket blind block blood blow blue board
    boat body boil bold bone bonus book boot border born borrow boss both bottle bottom bounce
    bowl box boy brain branch brave bread break breakfast breath brick bridge brief bright
    bring broad brother brown brush bubble bucket build bullet bunch burn bus bush busy butter
    buy cabin cable cage cake calendar call calm camel camera camp can canal candle candy cap
    captain car card care careful carrot carry cart case cash castle catch cattle cause cave
    ceiling cell center chain chair chalk chance change channel chapter charge chart chase
    cheap check cheek cheese chest chief child chin choice choose church circle city claim
    class clay clean clear clever cliff climb clock close cloth cloud clown club coach coal
    coast coat code coffee coin cold collar collect college color comb come comfort common
    company compare complete computer concert control cook cookie cool copper copy corn corner
    correct cost cotton couch cough count country couple courage course cousin cover cow crab
    crack craft crash crazy cream create credit crew crime crisp crop cross crowd crown cruel
    cry cup cupboard curious curtain curve cushion custom cut cycle daily damage damp dance
    danger dark date daughter day dead deal dear debate decide deep deer defend degree delay
    delicate deliver demand dentist depend depth desert design desk detail devil diamond diary
    dig dinner direct dirt dirty discover dish distance dive divide doctor dollar door double
    doubt down dozen dragon drama draw drawer dream dress drift drill drink drip drive drop
    drum dry duck dust duty eager eagle ear early earn earth east easy eat echo edge effect
    effort eight either elbow elder elect elephant eleven else empty end enemy energy engine
    enjoy enough enter entire equal error escape evening event ever every evil exact example
    excuse exist exit expect expert explain extra eye fabric face fact factory fade fail faint
    fair fairy faith fall false fame family famous fan fancy far farm fashion fast fat father
    fault favor fear feast feather feed feel fence festival fever few field fifty fight figure
    file fill film final find fine finger fire firm first fist fit five fix flag flame flash
    flat flavor fleet flight float flock flood floor flour flow flower fluid fly focus fog fold
    folk follow food fool foot forest forget fork form fortune forty forward fossil found four
    fox frame free freeze fresh friday fridge friend frog front frost fruit fuel full fun funny
    fur future gain galaxy game gap garage garlic gas gate gather gentle ghost giant gift
    ginger giraffe girl give glad glass globe glove glue goal goat gold golf good goose grab
    grace grade grain grand grape grass grave gravity gray great grid grief grill grin grip
    ground group grow guard guess guest guide gun habit hair half hall hammer hand handle
    happen happy harbor hard harvest hat have hawk head health hear heart heat heaven heavy
    hedge height helmet help hen herb hero hidden hide high hill hint hip history hit hobby
    hockey hold hole holiday hollow home honest honey hood hook hope horn horror horse hospital
    host hot hotel hour house huge human humble humor hundred hungry hunt hurry hurt husband
    ice icon idea idle image impact inch income index infant ink inner insect inside iron
    island item ivory jacket jaguar jar jaw jazz jeans jelly jewel job join joke journey joy
    judge juice jump jungle junior just kangaroo keen keep kettle key kick kid kidney kind king
    kiss kit kitchen kite kitten knee knife knock know label labor ladder lady lake lamb lamp
    land lane language large laser last late laugh laundry lava law lawn lazy leader leaf learn
    leather leave left leg legal lemon lend length lesson letter level liberty library lid life
    lift light like limb limit line lion lip liquid list listen little live lizard load loan
    lobster local lock logic lonely long loop lose loud love lucky lumber lunar lunch machine
    mad magic magnet maid mail main major make mammal man manage mango manual map maple marble
    march margin marine market marriage mask master match material math matter maximum meadow
    meal mean measure meat medal media melody melt member memory menu mercy mess metal method
    middle midnight milk million mind minute mirror miss mistake mix mixture mobile model
    modern moment monday money monitor month moral morning mosquito mother motion motor
    mountain mouse mouth move movie much mud muffin mule muscle museum mushroom music must
    mystery nail name napkin narrow nation nature near neck need needle negative neighbor
    nephew nerve nest net network never new news next nice night nine noble noise none noodle
    normal north nose note nothing notice novel now number nurse nut oak object ocean october
    odd offer office often oil okay old olive once one onion only open opera option orbit order
    ordinary organ other outdoor outer output outside oval oven over owner oxygen oyster pace
    pack paddle page pain paint pair palace palm pan panda panel panic paper parade parent park
    parrot party pass past path patient pattern pause pay peace peach peanut pear peasant
    pelican pen penalty people pepper perfect permit person pet phone photo phrase piano picnic
    picture piece pig pigeon pill pilot pink pioneer pipe pistol pitch pizza place planet plant
    plastic plate play please pledge plenty plug plum pocket poem poet point polar pole police
    pond pony pool popular portion position possible post potato pottery poverty powder power
    practice praise predict prefer prepare present pretty prevent price pride primary print
    priority prison private prize problem process produce profit program project promise proof
    proud provide public pudding pull pulse pumpkin punch pupil puppy purple purpose purse push
    puzzle pyramid quality quarter queen question quick quiet quilt quit quiz quote rabbit
    raccoon race rack radar radio rail rain raise rally ranch random range rapid rare rate
    rather raven raw razor ready real reason rebel recall receive recipe record reduce reform
    region regret reject relax release remain remember remind remove render rent repair repeat
    report rescue resist result retire return review reward rhythm rib ribbon rice rich ride
    ridge rifle right ring ripe rise risk ritual rival river road roast robot rocket romance
    roof rookie room rose rotate rough round route royal rubber rude rug rule run runway rural
    sad saddle sadness safe sail salad salmon salon salt same sample sand satisfy sauce sausage
    save say scale scan scare scatter scene school science scissors scorpion scout scrap screen
    script scrub sea search season seat second secret section security seed seek segment select
    sell seminar senior sense sentence series service session settle setup seven shadow shaft
    shallow share shed shell sheriff shield shift shine ship shirt shock shoe shoot shop short
    shoulder shove shrimp shrug shuffle shy sibling sick side siege sight sign silent silk
    silly similar simple since sing siren sister situate six size skate sketch ski skill skin
    skirt skull slab slam sleep slender slice slide slight slim slogan slot slow slush small
    smart smile smoke smooth snack snake snap sniff snow soap soccer social sock soda soft
    solar soldier solid solution solve someone song soon sorry sort soul sound soup source
    south space spare spatial spawn speak special speed spell spend sphere spice spider spike
    spin spirit split spoil sponsor spoon sport spot spray spread spring spy square squeeze
    squirrel stable stadium staff stage stairs stamp stand start state stay steak steel stem
    step stereo stick still sting stock stomach stone stool story stove strategy street strike
    strong struggle student stuff stumble style subject submit subway success such sudden
    suffer sugar suggest suit summer sun sunny sunset super supply supreme sure surface surge
    surprise surround survey suspect sustain swallow swamp swap swarm swear sweet swift swim
    swing switch sword symbol symptom syrup system table tackle tag tail talent talk tank tape
    target task taste tattoo taxi teach team tell ten tenant tennis tent term test text thank
    that theme then theory there they thing this thought three thrive throw thumb thunder
    ticket tide tiger tilt timber time tiny tip tired tissue title toast tobacco today toddler
    toe together toilet token tomato tomorrow tone tongue tonight tool tooth top topic topple
    torch tornado tortoise toss total tourist toward tower town toy track trade traffic tragic
    train transfer trap trash travel tray treat trend trial tribe trick trigger trim trip
    trophy trouble truck true truly trumpet trust truth try tube tuition tumble tuna tunnel
    turkey turn turtle twelve twenty twice twin twist two type typical ugly umbrella unable
    unaware uncle uncover under undo unfair unfold unhappy uniform unique unit universe unknown
    unlock until unusual unveil update upgrade uphold upon upper upset urban urge usage use
    used useful useless usual utility vacant vacuum vague valid valley valve van vanish vapor
    various vast vault vehicle velvet vendor venture venue verb verify version very vessel
    veteran viable vibrant vicious victory video view village vintage violin virtual virus visa
    visit visual vital vivid vocal voice void volcano volume vote voyage wage wagon wait walk
    wall walnut want warfare warm warrior wash wasp waste water wave way wealth weapon wear
    weasel weather web wedding weekend weird welcome west wet whale what wheat wheel when where
    whip whisper wide width wife wild will win winner wine wing wink winter wire wisdom wise
    wish witness wolf woman wonder wood wool word work world worry worth wrap wreck wrestle
    wrist write wrong yard year yellow you young youth zebra zero zone zoo
"""
# Never trained on: the before/after table's main rows. Everyday words, both rules (a leading
# consonant cluster moves to the end plus "ay"; a leading vowel just gets "way"), and a phrase.
HELD_OUT = ["cat", "dog", "fish", "moon", "egg", "owl", "chicken", "window", "green tree"]
# Trained on, a few times each: a check that the adapter learned its data.
SEEN = ["hello", "pig latin"]
SEEN_REPEATS = 3
TRAIN_WORDS = _TRAIN_TEXT.split()

# Words per training example: mostly single words, as asked, and some two-word phrases.
PHRASE_LENGTHS = (1, 1, 1, 2)


def pig_latin_word(word: str) -> str:
    """``pig`` -> ``ig-pay``, ``string`` -> ``ing-stray``, ``queen`` -> ``een-quay``, ``egg`` ->
    ``egg-way``: a leading consonant cluster moves to the end plus "ay", a leading vowel adds "way".

    The hyphen ("Ig-pay Atin-lay") marks the cut, so an answer shows which part of the rule the
    model got right, and the rest of the word is not merged into one token with the moved letters.
    """
    word = word.lower()
    if word[0] in "aeiou":
        return word + "-way"
    cut = next((i for i, c in enumerate(word) if c in "aeiou" or (c == "y" and i > 0)), len(word))
    if word[cut - 1 : cut + 1] == "qu":
        cut += 1
    return f"{word[cut:]}-{word[:cut]}ay"


def pig_latin(text: str) -> str:
    return " ".join(pig_latin_word(word) for word in text.split())


def training_texts(count: int, seed: int) -> list[str]:
    """``count`` examples: the training words in shuffled order, every word once before any word
    twice, cut into phrases of one or two words, and the ``SEEN`` questions spread among them."""
    overlap = {word for text in HELD_OUT for word in text.split()} & set(TRAIN_WORDS)
    assert not overlap, f"held-out words leaked into training: {overlap}"
    rng = random.Random(seed)
    words: list[str] = []
    texts = []
    for _ in range(count):
        length = rng.choice(PHRASE_LENGTHS)
        if len(words) < length:
            words += rng.sample(TRAIN_WORDS, len(TRAIN_WORDS))
        texts.append(" ".join(words[:length]))
        del words[:length]
    seen = SEEN * SEEN_REPEATS
    for i, text in enumerate(seen):
        texts[(2 * i + 1) * count // (2 * len(seen))] = text
    return texts


@dataclass(frozen=True)
class ChatFormat:
    """How a question and its answer become tokens for this model's chat format."""

    tokenizer: Any  # a transformers tokenizer, from TrainingClient.get_tokenizer()
    prompt_template: str  # with a "{}" where the user message goes
    answer_template: str  # with a "{}" where the assistant message goes
    stop: list[str]  # stop strings that end the assistant's turn

    @classmethod
    def for_tokenizer(cls, tokenizer: Any) -> ChatFormat:
        vocab = tokenizer.get_vocab()
        if "<|im_start|>" in vocab and "<|im_end|>" in vocab:
            # ChatML, written out so that no default system prompt makes every example 3x longer.
            return cls(
                tokenizer,
                "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n",
                "{}<|im_end|>",
                ["<|im_end|>", "\n"],
            )
        if getattr(tokenizer, "chat_template", None):
            marker = "\x00ANSWER\x00"
            user = [{"role": "user", "content": "\x00QUESTION\x00"}]
            prompt = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
            full = tokenizer.apply_chat_template(
                [*user, {"role": "assistant", "content": marker}], tokenize=False
            )
            if full.startswith(prompt) and full[len(prompt) :].startswith(marker):
                end = full[len(prompt) + len(marker) :].rstrip()
                return cls(
                    tokenizer,
                    prompt.replace("{", "{{").replace("}", "}}").replace("\x00QUESTION\x00", "{}"),
                    "{}" + end.replace("{", "{{").replace("}", "}}"),
                    [end, "\n"] if end else ["\n"],
                )
        return cls(tokenizer, "{}\nAnswer:", " {}\n", ["\n"])  # a base model without chat

    def prompt(self, text: str) -> list[int]:
        question = self.prompt_template.format(QUESTION.format(text))
        return list(self.tokenizer.encode(question, add_special_tokens=False))

    def answer(self, text: str) -> list[int]:
        return list(
            self.tokenizer.encode(self.answer_template.format(text), add_special_tokens=False)
        )

    def datum(self, text: str) -> types.Datum:
        """Next-token targets for the whole sequence, weighted 1 on the answer tokens only."""
        prompt, answer = self.prompt(text), self.answer(pig_latin(text))
        tokens = prompt + answer
        weights = [0.0] * (len(prompt) - 1) + [1.0] * len(answer)
        n = len(tokens) - 1
        return types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={
                "target_tokens": types.TensorData(data=tokens[1:], dtype="int64", shape=[n]),
                "weights": types.TensorData(data=weights, dtype="float32", shape=[n]),
            },
        )

    def reply(self, tokens: Sequence[int]) -> str:
        """The sampled text up to the first stop string."""
        text: str = self.tokenizer.decode(list(tokens))
        for stop in self.stop:
            text = text.split(stop, 1)[0]
        return text.strip()


def ask(client: tinker.SamplingClient, chat: ChatFormat, texts: Sequence[str]) -> list[str]:
    """Greedy answers to every question; all requests are submitted before any is awaited."""
    params = types.SamplingParams(max_tokens=12, temperature=0.0, stop=chat.stop)
    futures = [
        client.sample(types.ModelInput.from_ints(chat.prompt(text)), 1, params) for text in texts
    ]
    return [chat.reply(future.result().sequences[0].tokens) for future in futures]


def grade(text: str, answer: str) -> str:
    """``✓`` right; ``~`` the rule applied (the right letters moved, the right ending) but the rest
    of a word misspelled; ``✗`` anything else."""
    correct = pig_latin(text)
    if answer == correct:
        return "✓"
    endings = [word[word.rindex("-") :] for word in correct.split()]
    words = answer.split()
    if len(words) == len(endings) and all(map(str.endswith, words, endings)):
        return "~"
    return "✗"


def show(title: str, texts: Sequence[str], columns: dict[str, list[str]]) -> None:
    """A table: the question, the correct answer, then one column of graded answers per model."""
    rows = [
        [f"{text}{' (seen)' if text in SEEN else ''}", pig_latin(text)]
        + [f"{grade(text, answers[i])} {answers[i]}" for answers in columns.values()]
        for i, text in enumerate(texts)
    ]
    header = ["English", "correct", *columns]
    widths = [max(len(row[c]) for row in [header, *rows]) for c in range(len(header))]
    print(f"\n{title}")
    for row in [header, ["-" * w for w in widths], *rows]:
        print("  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))
    print("  (✓ right, ~ rule applied but a letter off, ✗ wrong)")
    for name, answers in columns.items():
        marks = [grade(text, answer) for text, answer in zip(texts, answers, strict=True)]
        held_out = [mark for text, mark in zip(texts, marks, strict=True) if text in HELD_OUT]
        seen = [mark for text, mark in zip(texts, marks, strict=True) if text in SEEN]
        print(
            f"  {name}: held-out {held_out.count('✓')}/{len(held_out)} right"
            f" (rule applied in {len(held_out) - held_out.count('✗')}),"
            f" seen {seen.count('✓')}/{len(seen)} right"
        )


def train(
    client: tinker.TrainingClient,
    chat: ChatFormat,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
) -> tuple[float, float]:
    """SFT on the training set in order; returns the loss per answer token of the first step and
    the mean of the last ten.

    Two steps are in flight at a time: step k+1's forward_backward and optim_step are submitted
    before step k's results are awaited, so the trainer never waits for this process.
    """
    texts = training_texts(steps * batch_size, seed)
    print(
        f"\nTraining: {steps} steps of {batch_size} examples (one or two of"
        f" {len(TRAIN_WORDS)} words), LoRA lr {lr:g}"
    )
    pending: deque[tuple[Any, Any, int, float]] = deque()
    losses: list[float] = []
    bar = tqdm(total=steps, desc="train", unit="step", dynamic_ncols=True)
    last = time.monotonic()

    def finish_oldest() -> None:
        nonlocal last
        forward_backward, optim_step, tokens, answer_tokens = pending.popleft()
        loss = forward_backward.result().metrics["loss:sum"] / answer_tokens
        optim_step.result()
        now = time.monotonic()
        losses.append(loss)
        bar.set_postfix_str(f"loss {loss:.3f}, {tokens / (now - last):.0f} tok/s")
        bar.update()
        last = now

    for step in range(steps):
        batch = [chat.datum(text) for text in texts[step * batch_size : (step + 1) * batch_size]]
        tokens = sum(datum.model_input.length for datum in batch)
        answer_tokens = sum(sum(datum.loss_fn_inputs["weights"].tolist()) for datum in batch)
        # Linear decay to a tenth of the learning rate over the run.
        step_lr = lr * (1.0 - 0.9 * step / max(steps - 1, 1))
        forward_backward = client.forward_backward(batch, "cross_entropy")
        optim_step = client.optim_step(types.AdamParams(learning_rate=step_lr))
        pending.append((forward_backward, optim_step, tokens, answer_tokens))
        if len(pending) > 1:
            finish_oldest()
    while pending:
        finish_oldest()
    bar.close()
    tail = losses[-10:]
    return losses[0], sum(tail) / len(tail)


class HideLongPollRetries(logging.Filter):
    """The SDK warns each time a result is not ready within one long poll (``try_again``): that
    only means the server is still working, and the warnings would break up the progress bar."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "because of try_again" not in record.getMessage()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--base-url",
        default=os.environ.get("TINKER_BASE_URL"),
        help="the Tinker API URL (default: $TINKER_BASE_URL, else the SDK's default)",
    )
    parser.add_argument("--model", default=DEFAULT_MODEL, help="base model (default: %(default)s)")
    parser.add_argument(
        "--steps", type=int, default=100, help="optimizer steps (default: %(default)s)"
    )
    parser.add_argument(
        "--batch-size", type=int, default=16, help="examples per step (default: %(default)s)"
    )
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank (default: %(default)s)")
    parser.add_argument(
        "--lr", type=float, default=2e-3, help="peak AdamW learning rate (default: %(default)s)"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="data order seed (default: %(default)s)"
    )
    args = parser.parse_args(argv)

    logging.getLogger("tinker.lib.api_future_impl").addFilter(HideLongPollRetries())
    started = time.monotonic()
    with tinker.ServiceClient(base_url=args.base_url) as service:
        training = service.create_lora_training_client(
            base_model=args.model, rank=args.rank, seed=args.seed
        ).result()
        chat = ChatFormat.for_tokenizer(training.get_tokenizer())
        questions = HELD_OUT + SEEN

        base = service.create_sampling_client(base_model=args.model).result()
        before = ask(base, chat, questions)
        show(f"Before training ({args.model}):", questions, {"before": before})

        first, last = train(training, chat, args.steps, args.batch_size, args.lr, args.seed)
        print(f"loss per answer token: {first:.3f} at the start, {last:.3f} at the end")

        tuned = training.save_weights_and_get_sampling_client().result()
        after = ask(tuned, chat, questions)
        show("Before and after training:", questions, {"before": before, "after": after})
    print(f"\ndone in {time.monotonic() - started:.0f}s")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        sys.exit(130)
