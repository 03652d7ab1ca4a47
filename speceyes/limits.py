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
