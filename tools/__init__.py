"""Tools that measure and extend the serving cluster: the benchmark (`tools.bench`, `specserve
bench`) and drafter distillation (`tools.distill`, `specserve distill`). They import the serving
packages (`cluster`, `deployments`); nothing that serves imports them."""
