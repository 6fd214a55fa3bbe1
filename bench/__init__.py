"""The benchmark harness behind ``ringcomm bench``. Its folder is ``bench/``; it installs as
``ringcomm_bench``, and the library never imports it."""
