"""OpenAI's Responses API on the router (`POST /v1/responses`, `GET` / `DELETE /v1/responses/{id}`).

A translation layer over the chat-completions path, as services/router/anthropic/ is: `models` holds
the request body and which of its fields are implemented, harmless or refused; `convert` turns input
items, tools, tool_choice, text.format and reasoning into the router's chat request; `response` turns
the chat result into output items (reasoning, message, function_call), status and usage; `stream`
turns chat stream chunks into the Responses API's SSE events; `store` keeps stored responses in Redis
under a TTL, so any router replica continues a conversation by `previous_response_id`; `endpoint`
mounts the routes. Nothing here talks to an engine directly.
"""
