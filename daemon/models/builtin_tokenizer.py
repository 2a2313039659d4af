"""The built-in model's tokenizer and chat template (see ``builtin``): a byte-level BPE with a
few merges and Qwen's added tokens, and a ChatML template of our own."""

from __future__ import annotations

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

# Added tokens in id order, with Qwen's special flags (think/tool markers are plain added tokens).
ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<think>", False),
    ("</think>", False),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
)

# Qwen-style pre-tokenisation: contractions, letter runs with one leading non-letter, single
# digits, punctuation runs, newline runs, spaces.
_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Pieces that get their own token; each is built by left-to-right merges, so every prefix of a
# piece is a token too. Order = merge rank.
_MERGE_PIECES: tuple[str, ...] = tuple(
    (
        " the| a| to| of| and| in| is| it| you| that| for| on| with| this| be| are| not| can"
        "| what| Hello| hello|Hello|ing|ed|er|re|on|an|en|at|or|es| I| The| We| def| return"
        "| import| class| if| else| None| name| arguments| function| call| tool| user| assistant"
        '| system|\n\n|  |    |        |":| "|",|{"|"}'
    ).split("|")
)


# --- tokenizer -------------------------------------------------------------------------------


def byte_to_char() -> dict[int, str]:
    """The byte-level BPE alphabet: printable Latin-1 bytes map to themselves, the other bytes to
    code points from 256 up, in byte order (so no token text is whitespace or a control char)."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    out = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def build_tokenizer() -> Tokenizer:
    """Byte-level BPE: 256 byte tokens (id = byte value), a few merges, then the added tokens."""
    b2c = byte_to_char()
    vocab = {b2c[b]: b for b in range(256)}
    merges: list[tuple[str, str]] = []
    for piece in _MERGE_PIECES:
        chars = "".join(b2c[b] for b in piece.encode("utf-8"))
        for i in range(2, len(chars) + 1):
            left, right = chars[: i - 1], chars[i - 1]
            if chars[:i] not in vocab:
                vocab[chars[:i]] = len(vocab)
                merges.append((left, right))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=False, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    for text, special in ADDED_TOKENS:  # one at a time: ids follow ADDED_TOKENS order
        token = AddedToken(text, special=special, normalized=False)
        if special:
            tok.add_special_tokens([token])
        else:
            tok.add_tokens([token])
    return tok


def tokenizer_config(ids: dict[str, int | None]) -> dict:
    decoder = {
        str(ids[text]): {
            "content": text,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
        for text, special in ADDED_TOKENS
    }
    return {
        "tokenizer_class": "Qwen2Tokenizer",
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "errors": "replace",
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "model_max_length": 8192,
        "chat_template": CHAT_TEMPLATE,
    }


# --- chat template ---------------------------------------------------------------------------

# ChatML. All literal text is emitted from expressions and every tag strips the whitespace around
# it, so the output does not depend on the template's own indentation (nor on trim/lstrip).
# Tools go into the system turn as a JSON list; assistant tool calls become <tool_call> blocks of
# {"name", "arguments"}; consecutive tool results share one user turn, each in <tool_response>;
# reasoning_content is wrapped in <think>; enable_thinking=false pre-fills an empty think block.
CHAT_TEMPLATE = """\
{%- macro text_of(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is iterable and content is not mapping -%}
        {%- for part in content -%}
            {%- if part is mapping and part.type == 'text' -%}
                {{- part.text -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- set has_system = messages | length > 0 and messages[0].role == 'system' -%}
{%- if tools -%}
    {{- '<|im_start|>system\\n' -}}
    {%- if has_system -%}
        {{- text_of(messages[0].content) + '\\n\\n' -}}
    {%- endif -%}
    {{- '# Tools\\n\\nYou can call the functions described by this JSON list of schemas:\\n<tools>\\n' -}}
    {{- tools | tojson -}}
    {{- '\\n</tools>\\n\\nTo call functions, answer with one block per call, each a JSON object' -}}
    {{- ' with the function name and its arguments:\\n<tool_call>\\n' -}}
    {{- '{"name": "<function name>", "arguments": {<argument values by name>}}\\n' -}}
    {{- '</tool_call><|im_end|>\\n' -}}
{%- elif has_system -%}
    {{- '<|im_start|>system\\n' + text_of(messages[0].content) + '<|im_end|>\\n' -}}
{%- endif -%}
{%- for message in messages -%}
    {%- if loop.first and has_system -%}
        {%- continue -%}
    {%- endif -%}
    {%- if message.role == 'user' or message.role == 'system' -%}
        {{- '<|im_start|>' + message.role + '\\n' + text_of(message.content) + '<|im_end|>\\n' -}}
    {%- elif message.role == 'assistant' -%}
        {%- set text = text_of(message.content) -%}
        {{- '<|im_start|>assistant\\n' -}}
        {%- if message.reasoning_content is string -%}
            {{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' -}}
        {%- endif -%}
        {{- text -}}
        {%- for call in message.tool_calls or [] -%}
            {%- set fn = call.function if call.function is defined else call -%}
            {%- if text or not loop.first -%}
                {{- '\\n' -}}
            {%- endif -%}
            {{- '<tool_call>\\n{"name": ' + (fn.name | tojson) + ', "arguments": ' -}}
            {%- if fn.arguments is string -%}
                {{- fn.arguments -}}
            {%- else -%}
                {{- (fn.arguments if fn.arguments is defined else {}) | tojson -}}
            {%- endif -%}
            {{- '}\\n</tool_call>' -}}
        {%- endfor -%}
        {{- '<|im_end|>\\n' -}}
    {%- elif message.role == 'tool' -%}
        {%- if loop.previtem is not defined or loop.previtem.role != 'tool' -%}
            {{- '<|im_start|>user' -}}
        {%- endif -%}
        {{- '\\n<tool_response>\\n' + text_of(message.content) + '\\n</tool_response>' -}}
        {%- if loop.nextitem is not defined or loop.nextitem.role != 'tool' -%}
            {{- '<|im_end|>\\n' -}}
        {%- endif -%}
    {%- else -%}
        {{- raise_exception('unsupported message role: ' + message.role) -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\\n' -}}
    {%- if enable_thinking is defined and not enable_thinking -%}
        {{- '<think>\\n\\n</think>\\n\\n' -}}
    {%- endif -%}
{%- endif -%}
"""
