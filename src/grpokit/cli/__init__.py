"""Front ends: the ``grpokit`` command (:mod:`.main`), the demo (:mod:`.demo`), evaluation with pass@k
(:mod:`.evaluate`), learning curves (:mod:`.plots`) and the HTML report (:mod:`.report`)."""
