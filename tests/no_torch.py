"""Python source that makes importing torch (and the packages built on it, and h2o where asked) fail, as on a
machine where they are not installed: prepend it to a ``python -c`` script run in a subprocess."""


def blocker(*extra: str) -> str:
    names = {"torch", "transformers", "lm_eval", "accelerate", *extra}
    return ("import sys\n"
            "class Block:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            f"        if name.split('.')[0] in {sorted(names)!r}:\n"
            "            raise ImportError(f'{name} is blocked')\n"
            "sys.meta_path.insert(0, Block())\n")
