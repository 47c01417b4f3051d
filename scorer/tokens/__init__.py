"""Request bodies → the exact token ids the engine sees → block keys (scorer.blocks).

`Tokenization` is the request-path stage (`RequestPreparer`); `load_tokenizer` loads one
local tokenizer; `render_chat` renders a chat body like vLLM + transformers.
"""

from scorer.tokens.chat import ChatError, render_chat
from scorer.tokens.registry import LocalTokenizer, TokenizerLoadError, load_tokenizer
from scorer.tokens.segments import SegmentCache
from scorer.tokens.service import NoTokenizer, Tokenization, TokenizedPrompt, TokenizeError

__all__ = [
    "ChatError",
    "LocalTokenizer",
    "NoTokenizer",
    "SegmentCache",
    "Tokenization",
    "TokenizeError",
    "TokenizedPrompt",
    "TokenizerLoadError",
    "load_tokenizer",
    "render_chat",
]
