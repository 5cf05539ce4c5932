"""`localrun serve`: one localhost REST endpoint in every dialect its clients speak (OpenAI
Chat Completions and Responses, Anthropic Messages, Ollama, llama-server) over a
continuous-batching scheduler."""
