"""`localrun serve`: one localhost REST endpoint in three dialects (OpenAI, Ollama,
llama-server) over a continuous-batching scheduler."""
