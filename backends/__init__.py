"""Model servers hotfit drives: llama.cpp's llama-server and OpenVINO GenAI."""
