"""Tool calling on ``pagedkv serve``, as vLLM's OpenAI server does it.

- :mod:`.types`: calls and stream deltas in the API's shapes.
- :mod:`.json_stream`: JSON read a character at a time and written canonically (streamed
  arguments that join to the whole-text arguments); :mod:`.call_scanner`: one call object.
- :mod:`.parser`: the parser interface and registry (``--tool-call-parser``); :mod:`.hermes`
  (``hermes``) and :mod:`.llama3_json` (``llama3_json``).
- :mod:`.forced`: ``tool_choice: "required"`` and a named function (the JSON schema the output is
  constrained to, and its reading).
- :mod:`.plan`: a request's ``tools``/``tool_choice`` checked, and what they make of its outputs.
- ``tool_chat_template_hermes.jinja``: the chat template used when the model's own renders no tools.
"""
