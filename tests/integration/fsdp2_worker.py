"""One rank of test_fsdp2_wiring.py (run by torch.distributed.run on gloo): accelerate's FSDP2 preparation of the
tiny PEFT model with the plugin arguments lorafleet's config produces, forced past accelerate's CPU gate; in save
mode also the trainer's final-adapter export of the sharded adapter.

argv: model_dir checkpoint_dir plugin_args_json mode(save|load) results_dir; each rank writes rank<N>.json there.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from accelerate import Accelerator
from accelerate.utils import FullyShardedDataParallelPlugin, load_fsdp_model, save_fsdp_model
from accelerate.utils.fsdp_utils import fsdp2_prepare_model
from lorafleet_trainer.ranks import leave_process_group
from lorafleet_trainer.run_state import export_final_adapter
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM


def main() -> None:
    model_dir, checkpoint, plugin_args, mode = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4]
    results = Path(sys.argv[5])
    accelerator = Accelerator(cpu=True)  # gloo; accelerate itself would drop an FSDP plugin here
    plugin = FullyShardedDataParallelPlugin(**plugin_args)
    accelerator.state.fsdp_plugin = plugin
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=1, lora_alpha=2, target_modules="all-linear", init_lora_weights=False))
    tokens = torch.randint(0, 100, (1, 16))
    with torch.no_grad():
        unsharded = model(input_ids=tokens).logits
    model = fsdp2_prepare_model(accelerator, model)
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    with torch.no_grad():
        gap = (model(input_ids=tokens).logits - unsharded).abs().max().item()
    lora_b_name, lora_b = next((n, p) for n, p in model.named_parameters() if "lora_B" in n)
    result = {"rank": accelerator.process_index, "world": accelerator.num_processes, "still_tied": embed is head,
              "sharded": isinstance(lora_b, DTensor), "logit_gap": gap}
    if mode == "save":
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        full = lora_b.full_tensor()  # what TRL's adapter save gathers on every rank
        if accelerator.is_main_process:
            torch.save(full, checkpoint / "lora_b.pt")
        save_fsdp_model(plugin, accelerator, model, str(checkpoint))
        # The trainer's final-adapter export, called on every rank as run_until_stopped does: rank 0 writes the
        # gathered tensors, equal to the full ones.
        final = export_final_adapter(SimpleNamespace(model=model, accelerator=accelerator), checkpoint.parent)
        if accelerator.is_main_process:
            saved = load_file(str(final / "adapter_model.safetensors"))
            result["final_adapter_equal"] = torch.equal(saved[lora_b_name.replace(".default", "")], full.cpu())
            result["final_adapter_tensors"] = len(saved)
    else:
        load_fsdp_model(plugin, accelerator, model, str(checkpoint))
        result["loaded_equal"] = torch.equal(lora_b.full_tensor(), torch.load(checkpoint / "lora_b.pt"))
    (results / f"rank{accelerator.process_index}.json").write_text(json.dumps(result))
    leave_process_group()  # as a trainer rank does: exiting with a live gloo group can abort (ranks.py)


if __name__ == "__main__":
    main()
