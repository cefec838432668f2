module doel/ollama_render

go 1.19
