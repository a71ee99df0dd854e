"""In-process generation (graphrun.LLM, graphrun.generate, graphrun.chat): a generation spec's
engine serving prompts given in Python, completions back in order, no files written.

asked.py: prompts, conversations and their parameters, checked, as the engine takes them;
llm.py: the engine built once from a spec or a model folder, and the calls on it.
"""

from graphrun.llm.llm import LLM, GenerateOutput, chat, generate

__all__ = ["LLM", "GenerateOutput", "chat", "generate"]
