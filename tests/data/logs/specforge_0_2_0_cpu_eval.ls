eagle3-best
eagle3-latest
eagle3-step16
eagle3-step32
eagle3.best_meta.json
