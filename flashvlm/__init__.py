"""flashvlm: a fast inference engine and server for vision-language models."""

from flashvlm.request import CompletionOutput, InvalidRequestError, RequestOutput, SamplingParams, TokenLogprobs

__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in torch and transformers; import it lazily so `import flashvlm` stays light.
    if name == "LLM":
        from flashvlm.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "TokenLogprobs",
           "InvalidRequestError", "__version__"]
