"""llama.cpp's llama-server: binary discovery (``discovery``), argv and child environment
(``flags``), process lifetime (``process``), logs and crash diagnosis (``logs``, ``crash``), the
chat call (``chat``), the allocation report (``allocation``), and the Backend (``backend``)."""
