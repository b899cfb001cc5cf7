"""The serving engines, apart from draftsmith's own loop (eval/): what a team deploys and draftsmith measures, feeds and
exports to.

- `engine`: the verdict in the engine a team deploys, one `Engine` interface for its three ways of knowing an
  engine's costs (`costs`: c and β, entered or measured), llama.cpp run here, a team's own deployment;
- `llama_cpp`, `llama_cpp_drafters`, `llama_cpp_measure`, `llama_cpp_figures`: llama.cpp built here (its converter,
  llama-server, the patches in `llama_cpp_patches/`), the drafters in its formats, their measurement and figures;
- `endpoint`, `deployment`: an OpenAI-compatible server (vLLM, SGLang, llama-server), its client and the verdict
  measured against it from outside (`engine=openai`);
- `formats`: one module per export format the engines load (EAGLE-3, EAGLE-1, DFlash, a draft LM), with the checks
  that read them back;
- `report`: the report's engine sections.
"""
