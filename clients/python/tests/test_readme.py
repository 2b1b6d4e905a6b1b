"""The README's examples run as written against a live atmost: each
```python block after a `<!-- readme-test -->` line, in order, in one
namespace, with the address 127.0.0.1:50051 replaced by the test server's."""

import pathlib
import re

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
BLOCK = re.compile(r"<!-- readme-test -->\n```python\n(.*?)\n```", re.DOTALL)


def test_readme_examples_run(server):
    blocks = BLOCK.findall(README.read_text("utf-8"))
    assert len(blocks) == 4, "the README's runnable examples went missing"
    namespace: dict = {}
    try:
        for block in blocks:
            exec(compile(block.replace("127.0.0.1:50051", server.address), "README.md", "exec"), namespace)
    finally:
        if "client" in namespace:
            namespace["client"].close()
    assert len(namespace["charges"]) == 2
