"""EMFormer (ICML 2026): multi-scale weather forecasting. The merged multi-scale convolution (:mod:`.conv`),
latitude weights (:mod:`.geo`), the sinusoid-weighted composite loss (:mod:`.loss`), WeatherBench2 metrics
(:mod:`.metrics`), the timm-registered model (:mod:`.model`) and the LightningModule (:mod:`.module`).

Importing this package imports nothing heavy; ``lightning_modules.emformer.model`` registers the timm models.
"""
