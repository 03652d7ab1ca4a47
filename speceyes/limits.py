"""Input limits shared by prompts, validation, datasets and the server: one source per limit.

The option count is fixed by the prompts (one letter per option, as the checkpoints were
trained); the others are defaults a server operator can change with ``speceyes serve`` flags.
"""

from __future__ import annotations

import string

MAX_OPTIONS = 10  # option letters A..J of the published prompts
OPTION_LETTERS = string.ascii_uppercase[:MAX_OPTIONS]

# Benchmark questions are a few hundred characters; a long text only costs prefill time.
MAX_QUESTION_CHARS = 4096
MAX_OPTION_CHARS = 512

# Pixels of one image, read from its header before decoding: 8K UHD (7680x4320, HR-Bench 8K)
# fits, 9400x9400 does not. A decoded RGB image of this size holds 120 MB.
MAX_IMAGE_PIXELS = 40_000_000
# Decoded pixels all admitted requests of a server may hold at once (about 480 MB of RGB).
MAX_PIXELS_IN_FLIGHT = 4 * MAX_IMAGE_PIXELS


def lone_surrogate(text: str) -> bool:
    """True when ``text`` holds a lone UTF-16 surrogate, which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


# ---- a server's request bodies and user text ----------------------------------------------
# Question plus options, in tokens of the served models' tokenizers (UTF-8 bytes where a model
# has no tokenizer here: a byte-level BPE token covers at least one byte). Far below the
# context of every supported model (Qwen-VL: 32 K and more; the tiny test models: 4096), and
# the image's tokens come on top.
MAX_TEXT_TOKENS = 2048
# The largest request body (also once inflated): one image as a data URI, and its question.
MAX_BODY_MB = 32.0
# Seconds a client has to send its whole request body (408 beyond): 32 MB at about 1 MB/s.
BODY_TIMEOUT_S = 60.0
# Request-body bytes (received, and inflated from gzip/deflate) all requests of a server may
# hold at once while they are read and parsed (429 beyond).
MAX_BODY_MB_IN_FLIGHT = 256.0
# JSON values in a chat request body. One image and a question are a few dozen; each value costs
# the parser about 60 bytes, so a 32 MB body of `[],[],...` would otherwise cost 800 MB (this
# bound: about 12 MB).
MAX_JSON_VALUES = 200_000
DRAIN_TIMEOUT_S = 30.0  # seconds admitted requests get to be answered after SIGTERM or Ctrl-C
FUNNEL_JOIN_S = 10.0  # then, the most the server waits for its funnel thread's last model call
