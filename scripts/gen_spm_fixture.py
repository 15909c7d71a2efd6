#!/usr/bin/env python3
"""Writes the SentencePiece GGUF tokenizer fixture used by
crates/nibble-formats/tests/spm_tokenizer.rs.

Trains a small BPE model with the `sentencepiece` package (byte fallback, user-defined and
control symbols, whitespace-only pieces) on generated text in many scripts, stores its vocabulary
in a GGUF file with the `gguf` package the way llama.cpp's converter does (`tokenizer.ggml.model =
"llama"`, tokens, scores, token types, special ids, add_bos / add_space_prefix), and records what
`sentencepiece` itself makes of held-out text: the ground truth a GGUF consumer must reproduce.

The model is trained with normalization_rule_name="identity" and remove_extra_whitespaces=False.
sentencepiece's defaults (nmt_nfkc, collapsing whitespace runs) are normalization steps that GGUF
files do not carry: llama.cpp's SentencePiece path only turns spaces into U+2581 and adds the
dummy prefix. With identity normalization the sentencepiece package does exactly that too, so its
output is the reference for any GGUF consumer.

Writes into crates/nibble-formats/tests/fixtures/spm/:
  spm.gguf            the tokenizer metadata, no tensors
  spm_expected.json   per line: the text, sentencepiece's ids, and its decode where that is not
                      the text; lines with control-token strings, whose expected ids follow
                      llama.cpp's rule (the text split at control tokens, each piece encoded by
                      sentencepiece with its dummy prefix); and a subset encoded by the same model
                      with add_dummy_prefix off (add_space_prefix = false in GGUF terms)

Usage (deterministic; rerunning rewrites identical files):
  python3 -m venv .venv-spm && .venv-spm/bin/pip install sentencepiece gguf protobuf
  .venv-spm/bin/python scripts/gen_spm_fixture.py
"""

import io
import json
import random
from pathlib import Path

import sentencepiece as spm
from gguf import GGUFWriter
from sentencepiece import sentencepiece_model_pb2 as pb

OUT = Path(__file__).resolve().parent.parent / "crates/nibble-formats/tests/fixtures/spm"
SEED = 0x73706D  # "spm"
VOCAB_SIZE = 3000
USER_DEFINED = ["<|tool|>", "@@", "[[ref]]"]
CONTROL = ["<|im_start|>", "<|im_end|>"]
# Normal pieces re-typed UNUSED after training (every UNUSED_EVERY-th piece from UNUSED_FROM),
# so that sentencepiece's resegmentation of unused pieces is part of what the fixture pins down.
UNUSED_FROM, UNUSED_EVERY, UNUSED_COUNT = 1200, 71, 20

ENGLISH = (
    "the of and to in is that it was for on are with as his they be at one have this from or "
    "had by word but what some we can out other were all there when up use your how said an "
    "each she which do their time if will way about many then them write would like so these "
    "her long make thing see him two has look more day could go come did number sound no most "
    "people my over know water than call first who may down side been now find any new work "
    "part take get place made live where after back little only round man year came show every "
    "good me give our under name very through just form sentence great think say help low line "
    "differ turn cause much mean before move right boy old too same tell does set three want air "
    "well also play small end put home read hand port large spell add even land here must big "
    "high such follow act why ask men change went light kind off need house picture try us again "
    "animal point mother world near build self earth father tokenizer merge score vocabulary"
).split()
LATIN = (
    "über straße grüße Mädchen Öl naïve café crème déjà vu façade garçon señor año niño "
    "pingüino corazón ação não coração São Paulo Łódź żółw Dvořák český Ærø smørrebrød Åland "
    "İstanbul ağaç ğüşıöç Việt Nam tiếng Việt quốc ngữ"
).split()
CYRILLIC = (
    "привет мир как дела хорошо спасибо пожалуйста здравствуйте Москва Россия язык слово "
    "токенизатор модель данные большой маленький Україна їжак ґанок Беларусь ў"
).split()
GREEK = "γειά σου κόσμε ευχαριστώ λόγος Αθήνα φιλοσοφία ψυχή ωκεανός άλφα βήτα".split()
ARABIC = "مرحبا بالعالم شكرا كتاب مدرسة اللغة العربية سلام القاهرة".split()
HEBREW = "שלום עולם תודה ספר ירושלים עברית".split()
DEVANAGARI = "नमस्ते दुनिया धन्यवाद भाषा हिन्दी किताब भारत शब्द".split()
THAI = "สวัสดี ขอบคุณ ภาษาไทย กรุงเทพ".split()
EMOJI = [
    "🦀", "😀", "😂", "🎉", "🔥", "👍", "👍🏽", "❤️", "🇫🇷", "🇯🇵", "👨‍👩‍👧", "🧑‍💻", "✨", "🙏",
    "🤖", "☕", "🍣", "⚡",
]
PUNCT = list(".,;:!?…—–-()[]{}<>\"'«»„“”‘’/\\|@#$%^&*_+=~`§°€£¥₹")
CODE = [
    "fn main() {", "}", "let x = 42;", "x += 1;", "if a == b {", "return Ok(());",
    "def f(x):", "print(f\"{x}\")", "for i in range(10):", "#include <stdio.h>",
    "SELECT * FROM t WHERE id = 7;", "https://example.com/a?b=c&d=e", "user@example.org",
    "C:\\Users\\nibble", "0x7fff_ffff", "a[i][j] = b->c;",
]


def cjk_word(rng: random.Random) -> str:
    kind = rng.randrange(4)
    n = rng.randint(1, 4)
    if kind == 0:  # common CJK ideographs
        return "".join(chr(rng.randint(0x4E00, 0x4FFF)) for _ in range(n))
    if kind == 1:  # hiragana
        return "".join(chr(rng.randint(0x3041, 0x3093)) for _ in range(n))
    if kind == 2:  # katakana
        return "".join(chr(rng.randint(0x30A1, 0x30F6)) for _ in range(n))
    return "".join(chr(rng.randint(0xAC00, 0xAD00)) for _ in range(n))  # hangul syllables


def number(rng: random.Random) -> str:
    kind = rng.randrange(5)
    if kind == 0:
        return str(rng.randint(0, 10 ** rng.randint(1, 12)))
    if kind == 1:
        return f"{rng.uniform(-1000, 1000):.{rng.randint(1, 5)}f}"
    if kind == 2:
        return f"{rng.randint(1900, 2099)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    if kind == 3:
        return f"+{rng.randint(1, 99)} {rng.randint(100, 999)} {rng.randint(1000, 9999)}"
    return f"{rng.randint(1, 100)}%"


def word(rng: random.Random) -> str:
    r = rng.random()
    if r < 0.40:
        w = rng.choice(ENGLISH)
        return w.capitalize() if rng.random() < 0.15 else w
    if r < 0.47:
        return rng.choice(LATIN)
    if r < 0.53:
        return rng.choice(CYRILLIC)
    if r < 0.56:
        return rng.choice(GREEK)
    if r < 0.59:
        return rng.choice(ARABIC)
    if r < 0.61:
        return rng.choice(HEBREW)
    if r < 0.64:
        return rng.choice(DEVANAGARI)
    if r < 0.66:
        return rng.choice(THAI)
    if r < 0.73:
        return cjk_word(rng)
    if r < 0.79:
        return number(rng)
    if r < 0.84:
        return rng.choice(EMOJI)
    if r < 0.92:
        return rng.choice(PUNCT)
    return rng.choice(CODE)


def separator(rng: random.Random) -> str:
    r = rng.random()
    if r < 0.80:
        return " "
    if r < 0.86:
        return ""
    if r < 0.91:
        return " " * rng.randint(2, 6)
    if r < 0.95:
        return "\t"
    if r < 0.98:
        return rng.choice([" \t ", "\t\t", " \n", "\n"])
    return rng.choice(["\r\n", "\n\n", ", ", ". "])


def line(rng: random.Random, max_words: int = 24) -> str:
    n = rng.randint(1, max_words)
    parts = [word(rng)]
    for _ in range(n - 1):
        parts.append(separator(rng))
        parts.append(word(rng))
    return "".join(parts)


# Characters the training text never shows, so they reach the tokenizer only through byte
# fallback: Gothic, Linear B, mathematical bold, Cherokee, CJK extension B, musical symbols,
# Ethiopic, and controls.
RARE = [
    "𐌰𐌱𐌲", "𐀀𐀁", "𝐀𝐁𝐂", "ᏣᎳᎩ", "𠀀𠀁", "𝄞𝄢", "ሰላም", "\x1b[0m", "\x7f", "\u00a0", "\u3000",
    "\ufeff", "e\u0301", "\u200b", "\u2028", "Ω≈ç√∫", "ℝ⊂ℂ", "½¾", "ﬁ", "Ⅻ", "①②",
]


def edge_lines(rng: random.Random) -> list[str]:
    """Lines built to hit whitespace handling, byte fallback and user-defined symbols."""
    out = ["", " ", "  ", "\t", "\n", " \t\n ", "a", " a", "a ", "  a  ", "\ta\t", "1234567890",
           "   leading spaces", "trailing spaces   ", "tabs\tinside\tthe\tline", "new\nline",
           "crlf\r\nline", "▁", "a▁b", " ▁ ", "▁▁x", "<|tool|>", "<|tool|>start", " <|tool|>",
           "x <|tool|> y", "@@@", "@@ @@", "[[ref]][[ref]]", "a@@b", "<s", "/s>", "<unk",
           "<|im_start", "im_end|>", "😀😀😀", "👨‍👩‍👧👨‍👩‍👧", "🇫🇷🇯🇵",
           "0" * 40, "9" * 17 + "." + "3" * 9, "?!" * 20, "—" * 10, " " * 33, "\t" * 9]
    for _ in range(260):
        kind = rng.randrange(8)
        base = line(rng, 12)
        if kind == 0:
            out.append(" " * rng.randint(1, 5) + base)
        elif kind == 1:
            out.append(base + " " * rng.randint(1, 5))
        elif kind == 2:
            out.append(base.replace(" ", " " * rng.randint(2, 4)))
        elif kind == 3:
            out.append(rng.choice(RARE) + base + rng.choice(RARE))
        elif kind == 4:
            at = rng.randint(0, len(base))
            out.append(base[:at] + rng.choice(USER_DEFINED) + base[at:])
        elif kind == 5:
            out.append("\t".join(line(rng, 4) for _ in range(rng.randint(2, 4))))
        elif kind == 6:
            out.append("\n".join(line(rng, 5) for _ in range(rng.randint(2, 4))))
        else:
            out.append(" ".join(line(rng, 30) for _ in range(rng.randint(4, 8))))  # long
    return out


def control_lines(rng: random.Random) -> list[str]:
    specials = CONTROL + ["<s>", "</s>", "<unk>"]
    out = ["<s>", "</s>", "<unk>", "<|im_start|>", "<|im_start|><|im_end|>", "<s>hello",
           "<s> hello", "hi</s>",
           "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n", "a<unk>b",
           " <|im_end|> ", "<|im_start|><|tool|>x", "<s><s>  two"]
    for _ in range(40):
        parts = []
        for _ in range(rng.randint(1, 4)):
            if rng.random() < 0.7:
                parts.append(line(rng, 6))
            parts.append(rng.choice(specials))
        out.append(rng.choice(["", " ", "\n"]).join(parts))
    return out


def train(rng: random.Random) -> tuple[bytes, bytes]:
    """The trained model, and the same with some pieces re-typed UNUSED."""
    sentences = [line(rng) for _ in range(40000)]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences),
        model_writer=model,
        model_type="bpe",
        vocab_size=VOCAB_SIZE,
        byte_fallback=True,
        character_coverage=0.9995,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        split_digits=True,
        user_defined_symbols=USER_DEFINED,
        control_symbols=CONTROL,
        num_threads=1,
        minloglevel=2,
    )
    trained = model.getvalue()
    proto = pb.ModelProto()
    proto.ParseFromString(trained)
    for k in range(UNUSED_COUNT):
        piece = proto.pieces[UNUSED_FROM + k * UNUSED_EVERY]
        assert piece.type == pb.ModelProto.SentencePiece.NORMAL, piece
        piece.type = pb.ModelProto.SentencePiece.UNUSED
    return trained, proto.SerializeToString()


def no_prefix(model: bytes) -> spm.SentencePieceProcessor:
    proto = pb.ModelProto()
    proto.ParseFromString(model)
    proto.normalizer_spec.add_dummy_prefix = False
    return spm.SentencePieceProcessor(model_proto=proto.SerializeToString())


def write_gguf(sp: spm.SentencePieceProcessor, model: bytes, path: Path) -> None:
    proto = pb.ModelProto()
    proto.ParseFromString(model)
    w = GGUFWriter(str(path), arch="llama")
    w.add_tokenizer_model("llama")
    w.add_token_list([p.piece.encode() for p in proto.pieces])
    w.add_token_scores([p.score for p in proto.pieces])
    # sentencepiece's piece types are llama.cpp's token types, value for value.
    w.add_token_types([int(p.type) for p in proto.pieces])
    w.add_bos_token_id(sp.bos_id())
    w.add_eos_token_id(sp.eos_id())
    w.add_unk_token_id(sp.unk_id())
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def compact(cases: list[dict]) -> str:
    """One case per line, so a regenerated fixture diffs line by line."""
    return "[\n" + ",\n".join(json.dumps(c, ensure_ascii=False) for c in cases) + "\n]"


def main() -> None:
    rng = random.Random(SEED)
    trained, model = train(rng)
    sp = spm.SentencePieceProcessor(model_proto=model)
    all_used = spm.SentencePieceProcessor(model_proto=trained)
    assert sp.get_piece_size() == VOCAB_SIZE

    held_out = [line(rng) for _ in range(1000)] + edge_lines(rng)
    specials = {p: sp.piece_to_id(p) for p in CONTROL + ["<s>", "</s>", "<unk>"]}
    # Control tokens in the text are a GGUF consumer's business (sentencepiece never parses
    # them); those lines are the control cases below.
    assert not any(s in text for text in held_out for s in specials)
    cases = []
    for text in held_out:
        ids = sp.encode(text)
        case = {"text": text, "ids": ids}
        decoded = sp.decode(ids)
        if decoded != text:
            case["decoded"] = decoded
        cases.append(case)

    control = []
    for text in control_lines(rng):
        ids, rest = [], text
        while rest:
            hits = [(rest.find(s), -len(s), s) for s in specials if s in rest]
            if not hits:
                ids += sp.encode(rest)
                break
            at, _, s = min(hits)  # leftmost, then longest
            ids += sp.encode(rest[:at]) + [specials[s]]
            rest = rest[at + len(s):]
        control.append({"text": text, "ids": ids})

    plain = no_prefix(model)
    unprefixed = [{"text": c["text"], "ids": plain.encode(c["text"])} for c in cases[::5]]

    OUT.mkdir(parents=True, exist_ok=True)
    write_gguf(sp, model, OUT / "spm.gguf")
    resegmented = sum(all_used.encode(c["text"]) != c["ids"] for c in cases)
    doc = (
        "{\n"
        f'"generator": "scripts/gen_spm_fixture.py",\n'
        f'"sentencepiece": "{spm.__version__}",\n'
        f'"cases": {compact(cases)},\n'
        f'"control_cases": {compact(control)},\n'
        f'"no_prefix_cases": {compact(unprefixed)}\n'
        "}\n"
    )
    json.loads(doc)
    (OUT / "spm_expected.json").write_text(doc, encoding="utf-8")
    byte_lines = sum(any(sp.is_byte(i) for i in c["ids"]) for c in cases)
    print(f"{len(cases)} lines ({byte_lines} with byte fallback, {resegmented} changed by "
          f"the unused pieces), {len(control)} control lines, {len(unprefixed)} without prefix")


if __name__ == "__main__":
    main()
