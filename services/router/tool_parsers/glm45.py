"""`--tool-call-parser glm45`: GLM-4.5/4.6's calls, the glm47 markup with a newline after the name
and around each key/value pair (`<tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n
</tool_call>`). The glm47 parser already skips whitespace between the parts, so this one is that
parser under the name vLLM and SGLang give it; `call_separator` is what a grammar puts between parts."""

from __future__ import annotations

from services.router.tool_parsers.glm47 import Glm47ToolParser


class Glm45ToolParser(Glm47ToolParser):
    name = "glm45"
    part_separator = "\n"
