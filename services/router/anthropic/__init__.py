"""The Anthropic Messages API on the router (`POST /v1/messages`, `/v1/messages/count_tokens`).

A translation layer over the chat-completions path: `models` holds the request bodies; `convert`
turns a Messages request into the router's chat request (roles, assistant tool calls, tool results,
tools, tool_choice, reasoning); `response` turns the chat result into content blocks, stop_reason
and usage; `stream` turns chat stream chunks into Anthropic's SSE events; `errors` gives failures
Anthropic's error body and status codes; `endpoint` mounts both routes on the FastAPI app. Nothing
here talks to an engine directly.
"""
