"""The report's engine sections (eval/engines/report.py): the verdict lines and the device the engine ran on."""


def test_engine_verdict_lines_rank_each_drafters_best_k():
    def r(drafter, k, x, verdict_):
        return {"category": "code", "drafter": drafter, "k": k, "engine_speedup": x, "engine_speedup_ci": (x - .1, x + .1),
                "engine_verdict": verdict_}

    from eval.engines.report import engine_verdict_lines

    (line,) = engine_verdict_lines([r("head", 2, 0.8, "turn it off"), r("head", 4, 1.2, "pays off"),
                                    r("mod", 2, 0.99, "undecided"), {**r("mod", 4, 1.0, None), "engine_speedup": None}])
    assert line == ("- **code**: head k=4 1.20× (1.10–1.30) → pays off; mod k=2 0.99× (0.89–1.09) → undecided")
    slow = {**r("head", 2, 0.74, "turn it off"), "engine_acceptance_length": 1.56, "engine_tau_to_pay": 2.2}
    (line,) = engine_verdict_lines([slow])  # what it keeps, and what it would need to keep to pay
    assert line == "- **code**: head k=2 0.74× (0.64–0.84) → turn it off (τ 1.56; it pays from τ 2.20 here)"
    lucky = {**slow, "engine_speedup": 1.1, "engine_verdict": "pays off"}  # measured above what the costs predict
    assert engine_verdict_lines([lucky]) == ["- **code**: head k=2 1.10× (0.64–0.84) → pays off"]


def test_the_report_names_the_device_the_engine_ran_on():
    """torch's view of the machine is not llama.cpp's: a GPU torch sees can sit idle under a CPU build, and a CUDA
    build offloads where torch has no GPU. The engine's lines name the device from llama-server's log; a report
    written before it was recorded keeps torch's."""
    from eval.engines import report as report_md

    hw = {"cpu": "AMD EPYC", "gpu": "NVIDIA H200", "torch_threads": 2, "torch": "2.13.0"}
    on = lambda device: {"hardware": hw, "settings": {"engine": {"name": "llama.cpp", "threads": 4,
                                                                  **({"device": device} if device else {})}}}
    assert report_md.engine_device(on("NVIDIA H200 (CUDA0), 31/31 layers")) == "NVIDIA H200 (CUDA0), 31/31 layers"
    assert report_md.engine_device(on("CPU")) == "AMD EPYC"
    assert report_md.engine_device(on(None)) == "NVIDIA H200"
