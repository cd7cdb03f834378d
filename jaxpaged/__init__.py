"""jaxpaged: a JAX LLM inference engine built around PagedAttention and block-level prefix caching."""

__version__ = "0.1.0"
