"""Tasks: what a run evaluates (multiple choice through lm-eval, summarization, perplexity, observations).

Imports core, cli and assets; never pipeline or bench."""
