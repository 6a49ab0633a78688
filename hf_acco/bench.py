"""``python -m hf_acco.bench``: the headline benchmark (2 ranks on a shaped link, loss to a target). It lives in
``hf_acco/tools/bench/``; the N-rank and multi-machine studies are ``python -m hf_acco.tools.bench.scaling`` and
``.multinode``."""

from hf_acco.tools.bench.headline import main

if __name__ == "__main__":
    main()
