"""Offline generation with the embedded default model (SmolLM2-135M-Instruct)."""

from fastdeploy import LLM, SamplingParams


def main() -> None:
    llm = LLM()
    params = SamplingParams(temperature=0.0, max_tokens=64)
    outputs = llm.chat([{"role": "user", "content": "What is the capital of France?"}], params)
    print(outputs[0].outputs[0].text)
    for out in llm.generate(["The three primary colors are", "def fibonacci(n):"], params):
        print(repr(out.prompt), "->", repr(out.outputs[0].text))


if __name__ == "__main__":
    main()
